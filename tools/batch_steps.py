"""One target forward by rows, four ways (docs/benchmarks.md, issue 28): dense ``F.linear`` (MKL),
oneDNN's reordered weights (the float32 default on the CPU), and MKL-packed weights for 11 and for
16 rows; random weights of the model's shape, context 256. One copy of the weights at a time.

    python tools/batch_steps.py [--model qwen2.5-coder-1.5b]
"""
from __future__ import annotations

import argparse

from autotune.measure.steps import time_steps
from runtime.pipeline import ModelPool
from runtime.transformer import CausalLM

SHAPES = [(1, 1), (4, 4), (8, 8), (11, 11), (13, 13), (16, 16), (32, 16), (44, 4)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    args = p.parse_args()
    pool = ModelPool(random_weights=True)
    target = pool.get(args.model, "float32")
    ways = (("dense", lambda: CausalLM(target.hf_model)),
            ("onednn", lambda: pool.target_for_width(target, "onednn", 1)),
            ("packed-11", lambda: pool.target_for_width(target, "mkl-packed", 11)),
            ("packed-16", lambda: pool.target_for_width(target, "mkl-packed", 16)))
    for label, build in ways:
        lm = build()
        lm.row_ways = {rows: "packed" for rows, _ in SHAPES}  # calls of the packed width, as a verify makes
        timed = time_steps(lm, SHAPES, repeats=2)
        print(label, " ".join(f"{r}r/{s}s:{t * 1e3:.0f}ms" for r, s, t in timed), flush=True)
        del lm
        pool._prepared.clear()  # one extra copy of the weights at a time


if __name__ == "__main__":
    main()
