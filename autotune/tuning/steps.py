"""Timed batched forwards: what a decode step of ``rows`` target rows over ``seqs`` sequences costs
on this machine (``CausalLM.forward_batch`` over caches holding ``context`` tokens): the start-up
profile of the serving worker's step cost and of ``measure``'s batch schedules."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from autotune.timing import time_calls
from runtime.linear import ROW_WAYS
from runtime.slots import SlotCache
from runtime.transformer import BatchPart, CausalLM

PROFILE_CONTEXT = 256  # tokens each profiled sequence holds (attention over zeros costs the same)


def batch_sizes(max_batch: int) -> list[int]:
    """The batch sizes a start-up profile times: 1, 2, 4, ... up to ``max_batch`` (at least 1)."""
    return [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= max_batch] or [1]


def step_shapes(max_batch: int, lengths: Sequence[int] = (0, 4)) -> list[tuple[int, int]]:
    """(rows, sequences) to time: batch sizes 1, 2, 4, ... up to ``max_batch``, each with every
    sequence verifying ``1 + k`` rows for each draft length ``k`` of ``lengths``, and each batch's
    plain step's rows as one sequence (what the sequences add, apart from their rows)."""
    sizes = batch_sizes(max_batch)
    return sorted({(b * (1 + k), b) for b in sizes for k in lengths} | {(b, 1) for b in sizes})


def time_steps(lm: CausalLM, shapes: Sequence[tuple[int, int]], context: int = PROFILE_CONTEXT,
               repeats: int = 1, slots: SlotCache | None = None) -> list[tuple[int, int, float]]:
    """-> (rows, sequences, seconds) per shape: the best of ``repeats`` timed forwards after one
    untimed (warm) forward. With ``slots`` (a compiled server's K/V slots) each sequence holds a
    slot, so the step runs as the server's batched steps run (``runtime.slots.slot_step``: the
    compiled graph of the row bucket) rather than as eager ragged forwards over caches of their own."""
    out = []
    with torch.inference_mode():
        for rows, seqs in shapes:
            per = [rows // seqs + (1 if i < rows % seqs else 0) for i in range(seqs)]
            holders = [] if slots is None else [object() for _ in per]
            if slots is None:
                held, caches = context, [lm.new_cache(context + n) for n in per]
            else:
                held = min(context, slots.capacity - max(per))
                caches = [slots.take(h, slots.capacity) for h in holders]
                if any(c is None for c in caches):
                    raise ValueError(f"{seqs} sequences need {seqs} free slots; the slot cache has {slots.free}")
            parts = [BatchPart(torch.zeros(n, dtype=torch.long, device=lm.device), c) for n, c in zip(per, caches)]

            def rewind() -> None:
                for cache in caches:
                    cache.length = held

            try:
                best = time_calls(lambda: lm.forward_batch(parts), repeats, lm.device, setup=rewind).best
            finally:
                for h in holders:
                    slots.give_back(h)
            out.append((rows, seqs, best))
    return out


def choose_row_ways(lm: CausalLM, max_rows: int) -> dict[int, dict[str, float]]:
    """Time batched steps of 2, 3, 4, ... up to ``max_rows`` rows both ways
    (``runtime.linear.run_rows``) and keep the faster per row count in ``lm.row_ways`` -> seconds
    by row count and way (empty for a model without a packed GEMM)."""
    if lm.backend != "mkl-packed":
        return {}
    width = lm.linears[0]["q"].width
    counts = sorted({r for r in (2, 3, 4, 8, width, width + 1, 16, 24, 32, 48, 64) if 2 <= r <= max_rows})
    timed: dict[int, dict[str, float]] = {}
    for rows in counts:
        timed[rows] = {}
        for way in ROW_WAYS:
            lm.row_ways = {rows: way}
            timed[rows][way] = time_steps(lm, [(rows, min(rows, 16))], repeats=1)[0][2]
    lm.row_ways = {rows: min(t, key=t.__getitem__) for rows, t in timed.items()}
    return timed
