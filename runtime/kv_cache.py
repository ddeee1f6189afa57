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
        shape = (n_kv_heads, capacity, head_dim)  # [Hkv, S, D]
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.capacity = capacity
        self.length = 0

    @property
    def n_layers(self) -> int:
        return len(self.keys)

    def check_room(self, n_new: int) -> None:
        if self.length + n_new > self.capacity:
            raise ValueError(
                f"KV cache full: {self.length} + {n_new} rows exceed capacity {self.capacity}"
            )

    def write(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v ``[Hkv, T, D]`` at slots ``[length, length + T)``; return views of all valid
        plus new rows ``[Hkv, length + T, D]``."""
        t = k.shape[1]
        end = self.length + t
        self.keys[layer][:, self.length : end] = k
        self.values[layer][:, self.length : end] = v
        return self.keys[layer][:, :end], self.values[layer][:, :end]

    def view(self, layer: int, n_new: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + n_new
        return self.keys[layer][:, :end], self.values[layer][:, :end]

    def advance(self, n_new: int) -> None:
        self.check_room(n_new)
        self.length += n_new

    def rollback(self, length: int) -> None:
        """Forget every slot at or after ``length``."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: cache holds {self.length} rows")
        self.length = length

    def commit(self, start: int, path_indices: Sequence[int] | torch.Tensor) -> None:
        """Keep the rows at slots ``start + path_indices`` (in that order) as slots
        ``[start, start + n)`` and drop everything after them."""
        idx = torch.as_tensor(path_indices, dtype=torch.long)
        n = int(idx.numel())
        if n and (int(idx.min()) < 0 or start + int(idx.max()) >= self.length):
            raise ValueError(f"commit path {idx.tolist()} outside cache rows [{start}, {self.length})")
        contiguous = bool(n == 0 or torch.equal(idx, torch.arange(n)))
        if not contiguous:
            src = idx + start
            for layer in range(self.n_layers):
                self.keys[layer][:, start : start + n] = self.keys[layer][:, src]
                self.values[layer][:, start : start + n] = self.values[layer][:, src]
        self.length = start + n
