"""The gguf projections of the 1.5B's shapes (Q4_K gate/up, Q6_K down, Q6_K head rows) at 1-64
activation rows: ggml's vec_dot per (weight row, activation row) against the extension's rows
kernels (each weight block decoded once for four activation rows), side by side in one run, with
the two checked bit-identical at every width; for Q4_K also the rows repacked by eight (the path
the model runs), checked row-invariant, with its largest difference to vec_dot's results. Weights
are random, quantised by ggml (a matrix this size sits in a large L3: one row here is faster than
in a whole model's step). With ``--prefill N``, also the packaged 1.5B's prefill of an N-token
prompt at gguf, the Q6_K rows kernels switched off and on in turn (three rounds each, the fastest
kept). With ``--draft``, also the packaged 0.5B draft's forward (mostly Q5_0 blocks) at 1-182 rows,
the rows kernels switched off and on in turn, twice.

    python tools/rows_kernels.py [--prefill 512] [--draft]
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.utils import benchmark

from runtime.kernels import load

Q4_K, Q6_K = 12, 14
SHAPES = (("gate_up Q4_K", Q4_K, 17920, 1536), ("down Q6_K", Q6_K, 1536, 8960), ("head rows Q6_K", Q6_K, 16384, 1536))


def _time(fn) -> float:
    return benchmark.Timer("fn()", globals={"fn": fn}).blocked_autorange(min_run_time=0.5).median * 1e3


def prefill(tokens: int) -> None:
    from autotune.measure.profile import forward_step, served_lm
    from runtime.pipeline import ModelPool

    ops = load()
    step = forward_step(served_lm(ModelPool().get("qwen2.5-coder-1.5b", "gguf")), 0, tokens, None, False)
    best = {False: float("inf"), True: float("inf")}
    for _ in range(3):
        for on in best:
            ops.use_rows_kernels(on)
            start = time.perf_counter()
            step()
            best[on] = min(best[on], time.perf_counter() - start)
    ops.use_rows_kernels(True)
    print(f"\n| {tokens}-token prefill | ms a token |\n|---|---|")
    for on, label in ((False, "Q6_K by vec_dot"), (True, "Q6_K by the rows kernels")):
        print(f"| {label} | {best[on] * 1e3 / tokens:.1f} |")


def draft_rows() -> None:
    from autotune.tuning.cost_model import forward_seconds
    from runtime.pipeline import ModelPool

    ops = load()
    pool = ModelPool()
    lm = pool.served(pool.get("qwen2.5-coder-0.5b", "gguf"))
    widths = (1, 4, 8, 13, 64, 182)
    print("\n| 0.5B draft forward, ms (after 192 cached rows; 182 rows after none) | "
          + " | ".join(str(r) for r in widths) + " |\n|---|" + "---|" * len(widths))
    for on in (False, True, False, True):
        ops.use_rows_kernels(on)
        ms = [forward_seconds(lm, r, 192 if r < 100 else 0, repeats=3) * 1e3 for r in widths]
        print(f"| {'rows kernels' if on else 'vec_dot per pair'} | " + " | ".join(f"{m:.1f}" for m in ms) + " |")
    ops.use_rows_kernels(True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", type=int, default=0, help="also time the 1.5B's prefill of this many tokens")
    parser.add_argument("--draft", action="store_true", help="also time the 0.5B draft's forwards by rows")
    args = parser.parse_args()
    torch.manual_seed(0)
    ops = load()
    print("| matrix | rows | vec_dot ms | rows kernels ms | x | identical | repacked ms | x | row-invariant "
          "| max diff / max vec_dot |\n|---|---|---|---|---|---|---|---|---|---|")
    for name, kind, n, k in SHAPES:
        w = ops.quantize(torch.randn(n, k), kind)
        packed = ops.repack(w, kind, k)
        for m in (1, 4, 8, 16, 64):
            x = torch.randn(m, k)
            want = ops.matmul(x, [w], [kind], by_vec_dot=True)
            same = torch.equal(ops.matmul(x, [w], [kind]), want)
            ref = _time(lambda: ops.matmul(x, [w], [kind], by_vec_dot=True))
            rows = _time(lambda: ops.matmul(x, [w], [kind]))
            line = f"| {name} {n}x{k} | {m} | {ref:.2f} | {rows:.2f} | {ref / rows:.2f} | {'yes' if same else 'NO'} |"
            if packed is not None:
                rt = ops.repacked_type(kind)
                alone = torch.cat([ops.matmul(x[i : i + 1], [packed], [rt]) for i in range(m)])
                invariant = torch.equal(ops.matmul(x, [packed], [rt]), alone)
                diff = ((alone - want).abs().max() / want.abs().max()).item()
                rep = _time(lambda: ops.matmul(x, [packed], [rt]))
                line += f" {rep:.2f} | {ref / rep:.2f} | {'yes' if invariant else 'NO'} | {diff:.1e} |"
            else:
                line += " - | - | - | - |"
            print(line)
    if args.prefill:
        prefill(args.prefill)
    if args.draft:
        draft_rows()


if __name__ == "__main__":
    main()
