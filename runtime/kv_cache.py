"""Preallocated, position-indexed KV cache (gpt-fast style) with rollback and tree-path commit."""
from __future__ import annotations

from collections.abc import Sequence

import torch


class KVCache:
    """One preallocated key and value tensor per layer, indexed by cache slot.

    Slots ``[0, length)`` hold valid entries. A forward pass writes its ``T`` new rows at
    ``[length, length + T)`` and then calls :meth:`advance`. Rolling back is moving ``length``;
    committing an accepted tree path gathers its rows into contiguous slots (Medusa style).
    """

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        if capacity <= 0:
            raise ValueError(f"KVCache capacity must be positive, got {capacity}")
        shape = (n_layers, n_kv_heads, capacity, head_dim)  # [L, Hkv, S, D]
        # one tensor per kind, so consecutive layers are one view (layer-parallel groups)
        with torch.inference_mode(False):  # normal tensors wherever allocated (compiled steps guard on it)
            self.all_keys = torch.zeros(shape, dtype=dtype, device=device)
            self.all_values = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.length = 0

    @property
    def n_layers(self) -> int:
        return self.all_keys.shape[0]

    def check_room(self, n_new: int) -> None:
        if self.length + n_new > self.capacity:
            raise ValueError(
                f"KV cache full: {self.length} + {n_new} rows exceed capacity {self.capacity}"
            )

    def slots(self, n_new: int) -> torch.Tensor:
        """The cache slots ``[length, length + n_new)`` of a forward's new rows, as a device tensor
        (built from host-side ints: no device read)."""
        return torch.arange(self.length, self.length + n_new, device=self.all_keys.device)

    def write(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor | None = None,
        key_len: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v ``[Hkv, T, D]`` at ``slots`` (default: ``[length, length + T)``) with
        ``index_copy_`` (static shapes: the slots are a device tensor); return the layer's keys and
        values over the whole capacity ``[Hkv, S, D]`` (the attention mask hides what is not
        valid), or over the first ``key_len`` slots."""
        if slots is None:
            slots = self.slots(k.shape[1])
        keys, values = self.all_keys[layer], self.all_values[layer]  # [Hkv, S, D] views
        keys.index_copy_(1, slots, k.to(keys.dtype))
        values.index_copy_(1, slots, v.to(values.dtype))
        if key_len is not None:
            return keys[:, :key_len], values[:, :key_len]
        return keys, values

    def write_layers(
        self, layers: slice, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor | None = None,
        key_len: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Like :meth:`write` for a run of consecutive layers at once: k, v ``[N, Hkv, T, D]``;
        returns ``[N, Hkv, S, D]``."""
        if slots is None:
            slots = self.slots(k.shape[2])
        keys, values = self.all_keys[layers], self.all_values[layers]
        keys.index_copy_(2, slots, k.to(keys.dtype))
        values.index_copy_(2, slots, v.to(values.dtype))
        if key_len is not None:
            return keys[:, :, :key_len], values[:, :, :key_len]
        return keys, values

    def view(self, layer: int, n_new: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + n_new
        return self.all_keys[layer][:, :end], self.all_values[layer][:, :end]

    def advance(self, n_new: int) -> None:
        self.check_room(n_new)
        self.length += n_new

    def rollback(self, length: int) -> None:
        """Forget every slot at or after ``length``."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: cache holds {self.length} rows")
        self.length = length

    def commit(self, start: int, path_indices: Sequence[int]) -> None:
        """Keep the rows at slots ``start + path_indices`` (in that order) as slots
        ``[start, start + n)`` and drop everything after them. ``path_indices`` are host ints (the
        decode loop has read the accepted path back already), so this reads nothing from the device."""
        path = [int(i) for i in path_indices]
        n = len(path)
        if n and (min(path) < 0 or start + max(path) >= self.length):
            raise ValueError(f"commit path {path} outside cache rows [{start}, {self.length})")
        if path != list(range(n)):
            src = torch.tensor(path, device=self.all_keys.device) + start
            self.all_keys[:, :, start : start + n] = self.all_keys[:, :, src]
            self.all_values[:, :, start : start + n] = self.all_values[:, :, src]
        self.length = start + n

    def snapshot(self, start: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        """Copy slots ``[start, length)`` of every layer (to undo a scratch forward)."""
        return self.length, self.all_keys[:, :, start : self.length].clone(), self.all_values[:, :, start : self.length].clone()

    def restore(self, start: int, snap: tuple[int, torch.Tensor, torch.Tensor]) -> None:
        length, keys, values = snap
        self.all_keys[:, :, start:length] = keys
        self.all_values[:, :, start:length] = values
        self.length = length
