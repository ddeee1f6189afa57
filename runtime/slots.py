"""A KV cache with a slot per sequence, and the static-shape batched step over it.

``SlotCache`` holds one key and one value tensor for ``n_slots`` sequences of ``capacity`` cache
rows each, plus scratch rows. A sequence's own ``KVCache`` is a view of its slot
(``SlotView``): prefill, drafting, rollback and commit act on it as on any cache, per slot. A
batched step (``slot_step``) runs every sequence's new rows as **one** forward over the whole
tensor: each row writes at its slot's next rows and attends only to its own slot under an
explicit mask (causal, or its tree's), so the step's shapes depend on nothing but the padded row
count. Rows are padded to ``ROW_BUCKETS`` (the pads write scratch rows and attend to themselves),
so a compiled model (``CausalLM.compile_steps``: ``fullgraph=True``, CUDA graphs on CUDA) builds
one graph per row bucket whatever the batch holds, and replays it.

Each row attends over every slot's keys (the others masked), so the attention reads
``n_slots`` times the keys a ragged step reads: the price of one static shape per bucket. The
eager CPU path keeps ragged steps (``CausalLM.forward_batch``) and uses slots only when compiled.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from runtime.attention import attend_mask
from runtime.kv_cache import KVCache

# ``lm`` below is a ``runtime.transformer.CausalLM`` and a part a ``BatchPart`` (that module imports
# this one, so their types are not imported here)

# a batched step's rows are padded up to one of these (then to multiples of the last)
ROW_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)


def row_bucket(rows: int) -> int:
    """The padded row count of a batched step of ``rows`` rows."""
    for b in ROW_BUCKETS:
        if rows <= b:
            return b
    top = ROW_BUCKETS[-1]
    return -(-rows // top) * top


class SlotView(KVCache):
    """One sequence's cache: rows ``[offset, offset + capacity)`` of a ``SlotCache``."""

    def __init__(self, owner: "SlotCache", offset: int, capacity: int) -> None:
        whole = owner.whole
        self.all_keys = whole.all_keys[:, :, offset : offset + capacity]
        self.all_values = whole.all_values[:, :, offset : offset + capacity]
        self.capacity, self.length = capacity, 0
        self.owner, self.offset = owner, offset


class SlotCache:
    """KV rows for ``n_slots`` sequences of ``capacity`` rows each, and ``scratch`` rows that a
    batched step's padding writes. A slot belongs to one holder (a decoder: it decodes one sequence
    at a time) from ``take`` to ``give_back``."""

    def __init__(self, lm: Any, n_slots: int, capacity: int, scratch: int | None = None) -> None:
        if n_slots < 1 or capacity < 1:
            raise ValueError(f"a slot cache needs slots and rows, got {n_slots} x {capacity}")
        d = lm.dims
        self.n_slots, self.capacity = n_slots, capacity
        self.scratch = ROW_BUCKETS[-1] if scratch is None else scratch
        total = n_slots * capacity + self.scratch
        self.whole = KVCache(d.n_layers, d.n_kv_heads, d.head_dim, total, lm.dtype, lm.device)
        if lm.device.type == "cuda":  # CUDA graphs replay fixed addresses (CausalLM._static_cache)
            torch._dynamo.mark_static_address(self.whole.all_keys, guard=False)
            torch._dynamo.mark_static_address(self.whole.all_values, guard=False)
        self._held: dict[int, int] = {}  # holder id -> slot index

    @property
    def bytes_per_slot(self) -> int:
        k = self.whole.all_keys
        return 2 * k.element_size() * k[:, :, :1].numel() * self.capacity

    @property
    def free(self) -> int:
        return self.n_slots - len(self._held)

    def take(self, holder: Any, capacity: int) -> SlotView | None:
        """``holder``'s slot, emptied (its own again, or a free one) -> None when ``capacity`` rows do
        not fit a slot or no slot is free."""
        if capacity > self.capacity:
            return None
        index = self._held.get(id(holder))
        if index is None:
            used = set(self._held.values())
            index = next((i for i in range(self.n_slots) if i not in used), None)
            if index is None:
                return None
            self._held[id(holder)] = index
        return SlotView(self, index * self.capacity, self.capacity)

    def give_back(self, holder: Any) -> None:
        self._held.pop(id(holder), None)


def slot_parts(parts: Sequence[Any]) -> SlotCache | None:
    """The slot cache every part's cache is a slot of (None: not all of one)."""
    owners = {id(p.cache.owner) if isinstance(p.cache, SlotView) else None for p in parts}
    if len(owners) != 1 or None in owners:
        return None
    return parts[0].cache.owner  # type: ignore[union-attr]


def slot_step(lm: Any, slots: SlotCache, parts: Sequence[Any]) -> list[torch.Tensor]:
    """One forward over every part's new rows, each part's cache a slot of ``slots`` -> logits per
    part (its ``logits_for`` rows). The rows are padded to ``row_bucket``; the forward is
    ``lm.forward_rows`` (compiled where ``lm`` is): one graph per bucket."""
    sizes = [int(p.tokens.shape[0]) for p in parts]
    rows = sum(sizes)
    padded = row_bucket(rows)
    if padded - rows > slots.scratch:
        raise ValueError(f"a batched step of {rows} rows needs {padded - rows} scratch rows; the slot cache has {slots.scratch}")
    total = slots.whole.capacity
    device = lm.device
    write, pos, tokens = [], [], []
    mask = torch.zeros(padded, total, dtype=torch.bool, device=device)
    at = 0
    for p, t in zip(parts, sizes):
        cache = p.cache
        cache.check_room(t)
        local = cache.slots(t)  # [t] rows inside the slot
        write.append(local + cache.offset)
        pos.append(local if p.positions is None else p.positions.to(device))
        mask[at : at + t, cache.offset : cache.offset + cache.capacity] = attend_mask(local, cache.capacity, p.rel_mask)
        tokens.append(p.tokens)
        at += t
    if padded > rows:  # each pad row writes its own scratch row and attends to it alone
        scratch = torch.arange(total - slots.scratch, total - slots.scratch + padded - rows, device=device)
        write.append(scratch)
        pos.append(torch.zeros(padded - rows, dtype=torch.long, device=device))
        mask[torch.arange(rows, padded, device=device), scratch] = True
        tokens.append(torch.zeros(padded - rows, dtype=torch.long, device=device))
    logits = lm.forward_rows(torch.cat(tokens), torch.cat(write), torch.cat(pos), mask, slots.whole)
    out = []
    for p, piece in zip(parts, logits[:rows].split(sizes)):
        p.cache.advance(int(p.tokens.shape[0]))
        out.append(piece if p.logits_for is None else piece[p.logits_for])
    return out
