"""Which correction scheme predicts decoding best: record the measured stretches the tuner and the
request controller give their corrections, then score each scheme on them in order.

``record`` runs a study and ``generate --adapt`` in this process (the real CLI paths) and writes
every ``Corrections.observe`` call - strategy, its uncorrected predictions, tokens, seconds - as
one JSON line. ``evaluate`` replays the lines: before each stretch, a scheme's factor (learnt from
the stretches before it, of the same source) times the stretch's mean prediction is its forecast;
the error is ``|ln(forecast / measured)|``. Schemes: ``none`` (factor 1), ``kind-ema`` (the
controller's former scheme: per drafter kind, an EMA of 0.3 over stretch ratios, clamped),
``strategy-total`` (the race's former scheme: per strategy, measured over mean predicted on its
evidence so far, unbounded; the kind's geometric mean before its first stretch) and
``strategy-ratio`` (``autotune.tuning.corrections``: the same with a range and a memory).

    python tools/correction_schemes.py record --out obs.jsonl -- study ARGS... -- generate ARGS...
    python tools/correction_schemes.py evaluate obs.jsonl [more.jsonl ...]
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autotune.tuning.corrections import CORRECTION_RANGE, Corrections
from search_spaces.strategy import Strategy

EMA = 0.3  # the controller's former weight of a new stretch


def record(out: Path, runs: list[list[str]]) -> None:
    from autotune.cli.main import main

    observe = Corrections.observe
    source: dict[str, Any] = {"name": "", "run": 0}

    def recording(self: Corrections, strategy: Strategy, predicted: Any, tokens: int, seconds: float) -> None:
        preds = [predicted] if isinstance(predicted, (int, float)) else list(predicted)
        with out.open("a") as f:
            f.write(json.dumps({"source": source["name"], "run": source["run"], "strategy": strategy.to_json(), "kind": strategy.drafter,
                                "predicted": preds, "tokens": tokens, "seconds": seconds}) + "\n")
        observe(self, strategy, predicted, tokens, seconds)

    Corrections.observe = recording  # type: ignore[method-assign]
    for i, argv in enumerate(runs):
        source["name"], source["run"] = argv[0], i
        code = main(argv)
        if code != 0:
            raise SystemExit(f"{' '.join(argv)} exited {code}")


def _clamp(x: float) -> float:
    return min(max(x, CORRECTION_RANGE[0]), CORRECTION_RANGE[1])


class KindEma:
    def __init__(self) -> None:
        self.f: dict[str, float] = {}

    def factor(self, row: dict) -> float:
        return self.f.get(row["kind"], 1.0)

    def observe(self, row: dict) -> None:
        ratio = _clamp(_measured(row) / _mean(row))
        old = self.f.get(row["kind"])
        self.f[row["kind"]] = ratio if old is None else (1 - EMA) * old + EMA * ratio


class StrategyTotal:
    def __init__(self) -> None:
        self.ev: dict[str, list[float]] = {}  # strategy -> tokens, seconds, sum of predictions, predictions
        self.kind: dict[str, str] = {}

    def _ratio(self, key: str) -> float:
        t, s, p, n = self.ev[key]
        return (t / s) / (p / n)

    def factor(self, row: dict) -> float:
        key = json.dumps(row["strategy"], sort_keys=True)
        if key in self.ev:
            return self._ratio(key)
        same = [self._ratio(k) for k in self.ev if self.kind[k] == row["kind"]]
        return math.exp(sum(math.log(c) for c in same) / len(same)) if same else 1.0

    def observe(self, row: dict) -> None:
        key = json.dumps(row["strategy"], sort_keys=True)
        ev = self.ev.setdefault(key, [0.0, 0.0, 0.0, 0.0])
        self.kind[key] = row["kind"]
        ev[0] += row["tokens"]
        ev[1] += row["seconds"]
        ev[2] += sum(row["predicted"])
        ev[3] += len(row["predicted"])


class StrategyRatio:
    def __init__(self) -> None:
        self.c = Corrections()

    def factor(self, row: dict) -> float:
        return self.c.factor(Strategy.from_json(row["strategy"]))

    def observe(self, row: dict) -> None:
        self.c.observe(Strategy.from_json(row["strategy"]), row["predicted"], row["tokens"], row["seconds"])


class Nothing:
    def factor(self, row: dict) -> float:
        return 1.0

    def observe(self, row: dict) -> None:
        pass


SCHEMES: dict[str, Callable[[], Any]] = {
    "none": Nothing, "kind-ema": KindEma, "strategy-total": StrategyTotal, "strategy-ratio": StrategyRatio,
}


def _mean(row: dict) -> float:
    return sum(row["predicted"]) / len(row["predicted"])


def _measured(row: dict) -> float:
    return row["tokens"] / row["seconds"]


def evaluate(paths: list[Path]) -> dict[str, dict[str, dict[str, float]]]:
    """Each run (a study, a generate) starts every scheme afresh, as the tuner and a server do;
    the errors of each source's runs are pooled."""
    rows = []
    for path in paths:
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                row["key"] = (str(path), row.get("run", row["source"]))
                rows.append(row)
    rows = [r for r in rows if r["tokens"] > 0 and r["seconds"] > 0 and [p for p in r["predicted"] if p > 0]
            and Strategy.from_json(r["strategy"]).speculates]  # plain decoding keeps no factor
    for r in rows:
        r["predicted"] = [p for p in r["predicted"] if p > 0]
    out: dict[str, dict[str, dict[str, float]]] = {}
    for source in sorted({r["source"] for r in rows}):
        mine = [r for r in rows if r["source"] == source]
        out[source] = {}
        for name, make in SCHEMES.items():
            errors, weights = [], []
            for key in dict.fromkeys(r["key"] for r in mine):
                scheme = make()
                for r in (r for r in mine if r["key"] == key):
                    errors.append(abs(math.log(_mean(r) * scheme.factor(r) / _measured(r))))
                    weights.append(r["tokens"])
                    scheme.observe(r)
            out[source][name] = {
                "stretches": len(errors), "mean_abs_log_error": statistics.fmean(errors),
                "median_abs_log_error": statistics.median(errors),
                "token_weighted_abs_log_error": sum(e * w for e, w in zip(errors, weights)) / sum(weights),
            }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("runs", nargs=argparse.REMAINDER, help="-- CLI ARGS [-- CLI ARGS ...]")
    e = sub.add_parser("evaluate")
    e.add_argument("paths", type=Path, nargs="+")
    args = p.parse_args()
    if args.cmd == "record":
        runs, cur = [], []
        for a in args.runs:
            if a == "--":
                if cur:
                    runs.append(cur)
                cur = []
            else:
                cur.append(a)
        if cur:
            runs.append(cur)
        record(args.out, runs)
    else:
        result = evaluate(args.paths)
        print(json.dumps(result, indent=2))
        for source, schemes in result.items():
            print(f"\n{source}: |ln(forecast / measured)| over the stretches, in order")
            print(f"{'scheme':<16} {'stretches':>9} {'mean':>7} {'median':>7} {'by tokens':>9}")
            for name, m in schemes.items():
                print(f"{name:<16} {m['stretches']:>9} {m['mean_abs_log_error']:>7.3f} "
                      f"{m['median_abs_log_error']:>7.3f} {m['token_weighted_abs_log_error']:>9.3f}")


if __name__ == "__main__":
    main()
