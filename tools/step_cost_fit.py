"""How well the serving worker's step cost prices batched target forwards (docs/benchmarks.md,
issue 28, stop 45): time a grid of (rows, sequences) on the target a server batches (the packaged
weights, float32 on oneDNN by default), fit ``autotune.tuning.load.StepCost`` on the shapes the
worker profiles at start-up (``step_shapes``), and print each grid point against the fit and
against one line through the same points (``base + per row + per sequence``, the fit it replaced).

    python tools/step_cost_fit.py [--model qwen2.5-coder-1.5b] [--precision float32] [--width 13]
"""
from __future__ import annotations

import argparse
import statistics

import numpy as np

from autotune.measure.steps import choose_row_ways, step_shapes, time_steps
from autotune.tuning.load import StepCost
from runtime.pipeline import ModelPool, verify_packing

BATCHES = (1, 2, 4, 8, 16)
ROWS_PER_SEQUENCE = (1, 2, 3, 5, 8, 13)


def line_fit(points: list[tuple[int, int, float]]) -> np.ndarray:
    x = np.array([[1.0, r, s] for r, s, _ in points])
    coef, *_ = np.linalg.lstsq(x, np.array([t for *_, t in points]), rcond=None)
    return np.maximum(coef, 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--precision", default="float32")
    ap.add_argument("--width", type=int, default=13, help="the server's verify width (packed copies use it)")
    args = ap.parse_args()
    pool = ModelPool(device="cpu")
    target = pool.get(args.model, args.precision)
    lm = pool.served(target)
    backend = verify_packing(lm, "cpu")
    if backend is not None:
        lm = pool.target_for_width(target, backend, args.width)
    choose_row_ways(lm, max(BATCHES) * args.width)
    profile = step_shapes(max(BATCHES))
    grid = sorted({(b * k, b) for b in BATCHES for k in ROWS_PER_SEQUENCE} | {(r, 1) for r in (1, 2, 4, 8, 16, 32, 64)}
                  | set(profile))
    timed = {(r, s): t for r, s, t in time_steps(lm, grid, repeats=2)}
    fit = StepCost([(r, s, timed[(r, s)]) for r, s in profile])
    # the line as the worker fitted it before: on the profile less the one-sequence shapes the new fit added
    added = {(b, 1) for b in BATCHES if b > 1}
    line = line_fit([(r, s, timed[(r, s)]) for r, s in profile if (r, s) not in added])
    print(f"line: {line[0] * 1e3:.1f} ms + {line[1] * 1e3:.2f} ms a row + {line[2] * 1e3:.2f} ms a sequence")
    print("fit knots (rows: ms of one sequence): " + ", ".join(f"{k:.0f}: {v * 1e3:.1f}" for k, v in zip(fit.knots, fit.values))
          + f"; {fit.per_seq * 1e3:.2f} ms a further sequence")
    print("| rows | sequences | timed ms | fit ms | line ms |\n|---|---|---|---|---|")
    errors: dict[str, list[float]] = {"fit": [], "line": []}
    for (r, s), t in sorted(timed.items()):
        f, li = fit.predict(r, s), float(line @ np.array([1.0, r, s]))
        errors["fit"].append(abs(f - t) / t)
        errors["line"].append(abs(li - t) / t)
        print(f"| {r} | {s} | {t * 1e3:.1f} | {f * 1e3:.1f} | {li * 1e3:.1f} |")
    for name, e in errors.items():
        print(f"{name}: mean error {100 * statistics.mean(e):.1f}%, largest {100 * max(e):.1f}% over {len(e)} shapes")


if __name__ == "__main__":
    main()
