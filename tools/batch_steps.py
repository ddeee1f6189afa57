"""One target forward by rows, three ways (docs/benchmarks.md, issue 28): dense ``F.linear``, and
MKL-packed weights for 11 and for 16 rows; random weights of the model's shape, context 256.

    python tools/batch_steps.py [--model qwen2.5-coder-1.5b]
"""
from __future__ import annotations

import argparse

from autotune.measure.steps import time_steps
from runtime.pipeline import ModelPool

SHAPES = [(1, 1), (4, 4), (8, 8), (11, 11), (13, 13), (16, 16), (32, 16), (44, 4)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    args = p.parse_args()
    pool = ModelPool(random_weights=True)
    target = pool.get(args.model, "float32")
    ways = (("dense", lambda: pool.served(target)),
            ("packed-11", lambda: pool.target_for_width(target, "mkl-packed", 11)),
            ("packed-16", lambda: pool.target_for_width(target, "mkl-packed", 16)))
    for label, build in ways:
        lm = build()
        lm.row_ways = {rows: "packed" for rows, _ in SHAPES}  # calls of the packed width, as a verify makes
        timed = time_steps(lm, SHAPES, repeats=2)
        print(label, " ".join(f"{r}r/{s}s:{t * 1e3:.0f}ms" for r, s, t in timed), flush=True)


if __name__ == "__main__":
    main()
