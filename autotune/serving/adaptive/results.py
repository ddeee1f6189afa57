"""A finished re-tune's result: checked on the first requests it tuned on (lossless, and at least as
fast as the strategy it would replace), then handed to the store writer as one ``Write``."""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autotune.serving.adaptive.clusters import unique_name
from autotune.serving.adaptive.retune import Retune, timed
from autotune.serving.adaptive.source import DecoderSource
from autotune.serving.adaptive.writer import Write
from autotune.store.records import ResultMetrics
from autotune.store.resolve import strategy_key
from autotune.store.storage import KeyTaken
from search_spaces.strategy import PLAIN, Strategy


@dataclass(frozen=True)
class Verdict:
    lossless: bool  # a speculative result's greedy output equals plain decoding's
    replaces: bool  # it decoded the requests at least as fast as the route's stored strategy


def check(decoders: DecoderSource, retune: Retune, strategy: Strategy, tokens: int) -> Verdict:
    """Decode ``retune``'s first requests (``tokens`` each, greedily) with plain decoding, with
    ``strategy`` and, when it would replace another speculative strategy, with that one."""
    prompts, eos, stored = retune.ids, retune.eos, retune.stored
    plain = timed(decoders.decoder(PLAIN), prompts, eos, tokens) if strategy.speculates or stored.speculates else None
    run = timed(decoders.decoder(strategy), prompts, eos, tokens) if strategy.speculates else plain
    if plain is not None and run is not None and run.outputs != plain.outputs:
        return Verdict(lossless=False, replaces=False)
    replaces = True
    if stored.speculates and stored != strategy and run is not None:
        before = timed(decoders.decoder(stored), prompts, eos, tokens)
        replaces = run.tps >= before.tps
    return Verdict(lossless=True, replaces=replaces)


@dataclass(frozen=True)
class Destination:
    """Where a server's re-tune results are stored: its store, under its model, draft and device."""

    storage: Any
    book: Any  # ``routing.book.StrategyBook``: refreshed once a result is stored
    target: Any
    draft: str | None
    device: str


def result_write(dest: Destination, retune: Retune, strategy: Strategy, tps: float, acceptance: float | None,
                 predicted: float | None, replaces: bool, hold: threading.Event,
                 on_stored: Callable[[dict[str, Any]], None]) -> Write:
    """The store write of ``retune``'s result (``replaces``: it becomes the route's best row); once
    stored, ``on_stored`` gets its event and ``hold`` is set."""
    tuning = retune.tuner.state.tuning_s / retune.wall_s if retune.wall_s else 0.0
    metrics = ResultMetrics.from_throughput(tps, acceptance=acceptance, predicted_tps=predicted,
                                            tuning_share=min(tuning, 1.0), study_name=f"serve:{retune.route}")
    prompts, supersedes, trials = list(retune.prompts), retune.supersedes, retune.tuner.state.trials
    task = retune.task

    def record() -> int:  # on the writer thread, retried there
        nonlocal task
        if retune.cluster is None:
            key = strategy_key(dest.target, dest.draft, task, dest.device)
            return dest.storage.record(key, strategy, metrics, prompts=prompts, supersedes=supersedes, offer=replaces)
        # a new route's name is claimed in the store: another replica may hold it since our last refresh
        taken = {b.key.task for b in dest.storage.list_best(**dest.book.scope)}
        while True:
            task = unique_name(retune.task, taken)
            try:
                return dest.storage.record(strategy_key(dest.target, dest.draft, task, dest.device), strategy,
                                           metrics, prompts=prompts, new_key=True)
            except KeyTaken:
                taken.add(task)

    def then(history_id: int) -> None:  # on the writer thread, once stored
        dest.book.refresh()
        on_stored({"event": "stored" if replaces else "kept", "route": retune.route, "task": task,
                   "strategy": strategy.to_dict(), "tokens_per_s": tps, "acceptance": acceptance,
                   "history_id": history_id, "tuning_share": tuning, "trials": trials})

    return Write(f"the re-tune of route {retune.route} (task {task})", record, then, done=hold)
