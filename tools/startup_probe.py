"""A server's start-up time and the share of it spent timing the controllers' cost models.

Builds a store of three SmolLM2 strategies (an int8 chain, an int8 tree, prompt lookup: the
continuous-batching tests' store) in a temporary directory and starts a server on it as
``autotune serve --model smollm2-135m --draft smollm2-135m --max-batch 8`` would, without the HTTP
listener; prints the seconds of ``build_server`` and of the cost models' timing. Run alone on the
machine (other work slows every forward):

    AUTOTUNE_DATA_DIR=../shared/data .venv/bin/python tools/startup_probe.py
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    from autotune.serving.server import ServeConfig, build_server
    from autotune.store.records import ResultMetrics
    from autotune.store.resolve import strategy_key
    from autotune.store.storage import open_storage
    from runtime.pipeline import ModelPool
    from search_spaces.strategy import Strategy

    model = "smollm2-135m"
    pool = ModelPool()
    target = pool.get(model, "float32")
    strategies = {"chain": Strategy(draft_length=4, draft_precision="int8"),
                  "tree": Strategy(draft_length=3, tree_widths=(2, 2, 1), draft_precision="int8"),
                  "lookup": Strategy(drafter="prompt-lookup", draft_length=6)}
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/store.db"
        with open_storage(url) as storage:
            for task, strategy in strategies.items():
                storage.record(strategy_key(target, model, task, "cpu"), strategy, ResultMetrics.from_throughput(10.0))
        with open_storage(url) as storage:
            started = time.perf_counter()
            server = build_server(ServeConfig(model=model, draft=model, storage=url, max_batch=8), storage, pool=pool)
            build_s = time.perf_counter() - started
            costs = list(server.worker.control._costs.values())
            print(f"start-up {build_s:.1f} s; {len(costs)} cost models, timed in "
                  f"{sum(c.calibration_s for c in costs):.1f} s")


if __name__ == "__main__":
    main()
