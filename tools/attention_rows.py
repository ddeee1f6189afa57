"""One layer's attention for the 1.5B's head shape (12 query heads over 2 key/value heads of 128,
float32): the padded-SDPA path int4 / w8a8 run (``sdpa_invariant``) against the ggml extension's row
kernel gguf runs (``attend_rows``), for one decode row at several cache lengths and a 760-row prompt.

    python tools/attention_rows.py
"""
from __future__ import annotations

import torch
from torch.utils import benchmark

from runtime.attention import attend_rows, sdpa_invariant
from runtime.layout import invariant_rows

H, HKV, D, S = 12, 2, 128, 4096


def _time(fn) -> float:
    return benchmark.Timer("fn()", globals={"fn": fn}).blocked_autorange(min_run_time=0.5).median * 1e3


def main() -> None:
    torch.manual_seed(0)
    k, v = torch.randn(HKV, S, D), torch.randn(HKV, S, D)
    scale = D ** -0.5
    print("| rows | keys | sdpa_invariant ms | attend_rows ms |\n|---|---|---|---|")
    for rows, keys in ((1, 64), (1, 512), (1, 2048), (760, 760)):
        start = keys - rows
        q = torch.randn(H, rows, D)
        slots = torch.arange(start, keys)
        mask = torch.arange(S)[None, :] <= slots[:, None]
        inv = invariant_rows(rows, start, slots, None, None, mask)
        padded = _time(lambda: sdpa_invariant(q, k, v, mask, scale, inv))
        by_rows = _time(lambda: attend_rows(q, k, v, mask, scale))
        print(f"| {rows} | {keys} | {padded:.3f} | {by_rows:.3f} |")


if __name__ == "__main__":
    main()
