"""A decode worker's start-up, while ``/health`` says loading: the shared verify width, every routed
strategy's decoder, the controllers' cost models, K/V slots, first decodes, compiled row buckets and
the batched-step profile (``start_up``, in that order), so no request pays for them."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from autotune.serving.costs import draft_key
from autotune.timing import Stopwatch
from autotune.tuning.load import DraftCost, StepCost
from autotune.tuning.steps import batch_sizes, choose_row_ways, step_shapes, time_steps
from runtime.decoding import GenerationConfig
from runtime.slots import ROW_BUCKETS, SlotCache, row_bucket
from runtime.transformer import BatchPart
from search_spaces.strategy import PLAIN, Strategy

if TYPE_CHECKING:
    from autotune.serving.worker import DecodeWorker

log = logging.getLogger("autotune.serve")


@dataclass(frozen=True)
class Started:
    """What start-up found: where ``unknown`` requests start, and what the first decodes and the
    compiled buckets cost."""

    fallback: Strategy  # what a request far from every stored task starts on (``Control.unknown_start``)
    warm_s: float
    slot_bytes: int = 0  # bytes per K/V slot (0: no slots)
    compile_s: float = 0.0


def start_up(worker: DecodeWorker, strategies: list[Strategy], default: Strategy, context: int) -> Started:
    """Ready ``worker`` to serve ``strategies`` (each routed strategy; ``default`` the server's
    untuned draft) with requests of up to ``context`` tokens: one named sequence, run once."""
    decoders, adapter = worker.decoders, worker.adapter
    decoders.share_width(strategies + worker.control.strategies(), adapter.width if adapter is not None else 0)
    for strategy in strategies:  # build (and load the draft for) every routed strategy now
        decoders.servable(strategy)  # one it cannot run is logged and decodes plainly, not a failed start
    decoders.freeze_width()  # one packed target from now on
    worker.control.prepare(strategies)  # the controllers' cost models, timed now rather than in a request
    fallback = worker.control.unknown_start(default)  # plain, or the default draft where it pays here
    if adapter is not None:
        adapter.prepare()  # the re-tunes' cost model too
    # first-call costs (the prefill's bf16 weight copies, dequantised from the GGUF file; compiled
    # steps under --compile) are paid now, not by the first requests
    slot_bytes = use_slots(worker, context)  # serve --compile with batching: batched steps over K/V slots
    compiled = worker.decoders.pool.compile
    warm_s = warm_up(worker, strategies)
    log.info("first decodes%s done in %.1f s", " (compiled steps)" if compiled else "", warm_s)
    compile_s = 0.0
    if slot_bytes:
        compile_s = compile_buckets(worker)
        log.info("%d K/V slots of %.0f MiB; batched steps compiled per row bucket in %.1f s",
                 decoders.slots.n_slots if decoders.slots is not None else 0, slot_bytes / 2**20, compile_s)
    if worker.config.max_batch > 1:
        profile_steps(worker)  # what a batched step costs on this machine (draft lengths shrink with load)
    return Started(fallback, warm_s, slot_bytes, compile_s)


def use_slots(worker: DecodeWorker, context: int) -> int:
    """Under ``serve --compile`` with batching: keep every running sequence's K/V in one slot
    cache (a slot per request, and one for a re-tune decoding alone), so each batched step runs as
    one compiled forward per row bucket (``runtime.slots``) -> bytes per slot (0: not used)."""
    decoders, max_batch = worker.decoders, worker.config.max_batch
    lm = decoders.batch_target()
    if not (decoders.pool.compile and max_batch > 1 and lm.is_compiled and lm.windows is None):
        return 0
    slots = SlotCache(lm, max_batch + 1, context + 2 * max(decoders.verify_width, 1) + 2)
    decoders.use_slots(slots)
    return slots.bytes_per_slot


def warm_up(worker: DecodeWorker, strategies: list[Strategy], tokens: int = 24) -> float:
    """Decode a short dummy prompt with each servable strategy, as a request would (``acquire``:
    with K/V slots a lone request's steps run on its slot, whose graphs a decode on a cache of its
    own would not build) -> seconds spent."""
    prompt = list(range(1, 9))
    decoders = worker.decoders
    with Stopwatch() as warming:
        for strategy in dict.fromkeys([PLAIN, *strategies]):
            if decoders.servable(strategy) is None:
                dec = decoders.acquire(strategy)
                try:
                    dec.generate(prompt, GenerationConfig(max_new_tokens=tokens))
                finally:
                    decoders.release(strategy, dec)
    return warming.seconds


def compile_buckets(worker: DecodeWorker) -> float:
    """Under slots: one batched step at every row bucket a step can reach, so each bucket's graph
    is built while ``/health`` says loading -> seconds spent."""
    slots = worker.decoders.slots
    if slots is None:
        return 0.0
    lm, holder = worker.decoders.batch_target(), object()
    with Stopwatch() as compiling:
        for rows in [b for b in ROW_BUCKETS if b <= bucket_limit(worker)]:
            cache = slots.take(holder, rows)
            if cache is None:
                break
            with torch.inference_mode():
                lm.forward_batch([BatchPart(torch.zeros(rows, dtype=torch.long, device=lm.device), cache)])
        slots.give_back(holder)
    return compiling.seconds


def profile_steps(worker: DecodeWorker) -> None:
    """Time batched target forwards at a few (rows, sequences), and the draft model's depth
    forward at each batch size: the step cost's and the draft cost's start-up profiles (the real
    steps refine them)."""
    decoders, config, figures = worker.decoders, worker.config, worker.figures
    lm = decoders.batch_target()
    ways = choose_row_ways(lm, config.max_batch_rows or config.max_batch * decoders.verify_width)
    if ways:
        log.info("batched rows run %s", ", ".join(f"{r}: {lm.row_ways[r]}" for r in sorted(ways)))
    shapes = step_shapes(config.max_batch)
    if decoders.slots is not None:  # the compiled buckets' steps over K/V slots, as requests run them
        shapes = [(r, s) for r, s in shapes if r <= bucket_limit(worker)]  # (a slot each: max_batch + 1 slots)
    figures.step_cost = StepCost(time_steps(lm, shapes, slots=decoders.slots))
    if decoders.pool.compile:  # a compiled draft would compile each new shape: real steps price it
        return
    drafts = {draft_key(d): d.drafter_of("draft-model").model for d in decoders.decoders.values() if draft_key(d)}
    shapes = [(b, b) for b in batch_sizes(config.max_batch)]  # one depth: a row for each sequence
    for key, model in drafts.items():
        cost = figures.draft_costs[key] = DraftCost([(seqs, t) for _, seqs, t in time_steps(model, shapes)])
        log.info("a draft depth forward costs %.1f ms + %.1f ms a sequence", cost.fixed * 1e3, cost.per_seq * 1e3)


def bucket_limit(worker: DecodeWorker) -> int:
    """The widest row bucket a batched step can reach: the step's row budget, else every
    sequence at the verify width."""
    config = worker.config
    return row_bucket(config.max_batch_rows or config.max_batch * max(worker.decoders.verify_width, 1))
