"""Record a draft-chain strategy into a store under the key of another store's best: how the
benches' "today's `tuned`" rows re-recorded an earlier study's pick (`tuned:db=FILE` reads it).

    python tools/record_strategy.py T_auto.db T_easy.db --draft-length 4 --threshold 0.4
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune.store.records import ResultMetrics  # noqa: E402
from autotune.store.storage import open_storage  # noqa: E402
from search_spaces.strategy import Strategy  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", help="SQLite file whose (only) stored best gives the key")
    ap.add_argument("dest", help="SQLite file to record into")
    ap.add_argument("--draft-length", type=int, required=True)
    ap.add_argument("--threshold", type=float, required=True)
    args = ap.parse_args()
    with open_storage(f"sqlite:///{args.source}") as src:
        key = src.list_best()[0].key
    strategy = Strategy(drafter="draft-model", draft_length=args.draft_length, confidence_threshold=args.threshold)
    with open_storage(f"sqlite:///{args.dest}") as dst:
        dst.record(key, strategy, ResultMetrics(score=1.0, study_name="re-recorded"))
        print(dst.list_best()[0].strategy_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
