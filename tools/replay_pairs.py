"""`auto` beside plain on the same sends of a `replay --json` file, per category: the mean
difference of each stage to the first token (the server's `stages`), and on the requests `auto`
decoded plainly (nothing drafted, no tuning) its time per token after the first and its latency
over plain's (means). What `auto`'s own work costs around a plain request.

    python tools/replay_pairs.py runE.json runF.json
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune.measure.replay import ReplayRecord  # noqa: E402

STAGES = ("admit_s", "prefill_s")


def per_token(r: ReplayRecord) -> float:
    return (r.latency_s - r.ttft_s) / (r.completion_tokens - 1)


def report(path: str) -> None:
    records = [ReplayRecord.from_dict(row) for row in json.loads(Path(path).read_text())["records"]]
    sends: dict[tuple[str, int], dict[str, ReplayRecord]] = {}
    for r in records:
        sends.setdefault((r.prompt_id, r.send), {})[r.mode] = r
    pairs = [(m["auto"], m["plain"]) for m in sends.values() if "auto" in m and "plain" in m]
    print(path)
    by_category: dict[str, list[tuple[ReplayRecord, ReplayRecord]]] = {}
    for a, p in pairs:
        if all(s in a.stages and s in p.stages for s in STAGES):  # a tuning request has no prefill stage
            by_category.setdefault(a.category, []).append((a, p))
    for category, got in by_category.items():
        diffs = "  ".join(f"{s} {statistics.mean(a.stages[s] - p.stages[s] for a, p in got) * 1e3:+7.1f} ms"
                          for s in STAGES)
        print(f"  {category:<12} {len(got):3d} sends  {diffs}")
    plain = [(a, p) for a, p in pairs if a.drafted == 0 and a.tuning_s is None and a.completion_tokens > 2]
    if plain:
        step = statistics.mean(per_token(a) / per_token(p) for a, p in plain)
        latency = statistics.mean(a.latency_s / p.latency_s for a, p in plain)
        print(f"  decoded plainly by auto: {len(plain)} sends, per token after the first {step:.3f}x plain, "
              f"latency {latency:.3f}x")


def main() -> int:
    if len(sys.argv) < 2:
        print("usage: python tools/replay_pairs.py REPLAY.json [...]", file=sys.stderr)
        return 2
    for path in sys.argv[1:]:
        report(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
