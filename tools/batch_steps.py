"""One target forward by rows, four ways (docs/benchmarks.md, issue 28): dense ``F.linear`` (MKL),
oneDNN's reordered weights (the float32 default on the CPU), and MKL-packed weights for 11 and for
16 rows; random weights of the model's shape, context 256. One copy of the weights at a time.

    python tools/batch_steps.py [--model qwen2.5-coder-1.5b]
    python tools/batch_steps.py --kernels   # one 8960x1536 float32 GEMM: MKL vs oneDNN by rows, and
                                            # oneDNN's row invariance and weight-layout hint
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from autotune.measure.steps import time_steps
from runtime.pipeline import ModelPool
from runtime.transformer import CausalLM

SHAPES = [(1, 1), (4, 4), (8, 8), (11, 11), (13, 13), (16, 16), (32, 16), (44, 4)]


def best_ms(fn, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best * 1e3


def kernels() -> None:
    """The 1.5B's MLP projection (8960x1536, float32) by rows: MKL's ``F.linear`` against oneDNN on
    reordered weights (``runtime.linear.OneDnnLinear``), a lone row as itself and as two; whether a
    row's oneDNN result depends on the call's row count, and on the layout hint."""
    from runtime.linear import ONEDNN_ROWS_HINT, OneDnnLinear

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(8960, 1536, generator=gen) * 0.02
    x = torch.randn(512, 1536, generator=gen)
    lin = OneDnnLinear(w, None)

    def raw(rows: torch.Tensor, packed: torch.Tensor = lin.packed) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(rows, packed, None, "none", [], "")

    for rows in (1, 2, 16, 64, 512):
        xs = x[:rows].contiguous()
        line = f"{rows} rows: F.linear {best_ms(lambda: F.linear(xs, w)):.2f} ms, oneDNN {best_ms(lambda: lin(xs)):.2f} ms"
        if rows == 1:
            line += f" (unpadded {best_ms(lambda: raw(xs)):.2f} ms)"
        print(line, flush=True)
    whole = lin(x)
    same = {rows: torch.equal(lin(x[:rows].contiguous()), whole[:rows]) for rows in (1, 2, 3, 11, 16, 17, 128)}
    print("oneDNN rows equal their 512-row call:", same, "| a lone row unpadded:", torch.equal(raw(x[:1]), whole[:1]))
    hints = {h: torch.equal(raw(x, torch.ops.mkldnn._reorder_linear_weight(w, h)), whole) for h in (1, 2, 128)}
    print(f"layout hint {ONEDNN_ROWS_HINT} vs others, same 512 rows:", hints)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--kernels", action="store_true", help="time one float32 GEMM's kernels instead")
    args = p.parse_args()
    if args.kernels:
        kernels()
        return
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
