"""How close a plain step at ``--precision gguf`` comes to this machine's memory bandwidth.

    python tools/bandwidth.py [--model qwen2.5-coder-1.5b] [--tokens 32] [--prompt 150]

1. The machine's read bandwidth: a 1 GiB array summed on torch's threads, best of 5 (a simple
   large-array read, as STREAM's "sum" would).
2. The bytes of weights one plain step reads (every projection and the head, as GGUF blocks; the
   embedding reads one row) and the step's time: a plain greedy decode of ``--tokens`` tokens after a
   short prompt, its decode rounds only.
3. Effective bandwidth = bytes per token / seconds per token, and its share of (1).
4. The prefill of a ``--prompt``-token prompt, per prompt token (the same kernels, every row).
"""
from __future__ import annotations

import argparse
import time

import torch


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    x = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best


def main() -> None:
    from runtime.decoding import Decoder, GenerationConfig
    from runtime.pipeline import ModelPool, build_decoder
    from search_spaces import PLAIN

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=150)
    args = ap.parse_args()

    bandwidth = read_bandwidth()
    pool = ModelPool()
    target = pool.get(args.model, "gguf")
    decoder: Decoder = build_decoder(pool, target, PLAIN)
    lm = decoder.target
    weight_bytes = sum(int(seg.numel()) for layer in lm.linears for lin in layer.values() for seg in lin.segments)
    weight_bytes += sum(int(seg.numel()) for seg in lm.head.segments)
    prompt = list(range(100, 116))
    cfg = GenerationConfig(max_new_tokens=args.tokens)
    decoder.generate(prompt, GenerationConfig(max_new_tokens=4))  # warm
    out = decoder.generate(prompt, cfg)
    rounds = out.stats.new_tokens - 1  # the first token comes from the prefill
    per_token = (out.stats.wall_s - out.stats.prefill_s) / max(rounds, 1)
    effective = weight_bytes / per_token
    print(f"machine read bandwidth: {bandwidth / 1e9:.1f} GB/s ({torch.get_num_threads()} threads, 1 GiB sum)")
    print(f"{args.model} at gguf: {weight_bytes / 1e6:.0f} MB of blocks a step, {per_token * 1e3:.1f} ms a token "
          f"-> {effective / 1e9:.1f} GB/s effective, {100 * effective / bandwidth:.0f}% of the read bandwidth")
    long = decoder.generate(list(range(1000, 1000 + args.prompt)), GenerationConfig(max_new_tokens=1))
    print(f"prefill of {args.prompt} tokens: {long.stats.prefill_s:.2f} s, "
          f"{1e3 * long.stats.prefill_s / args.prompt:.1f} ms a prompt token")


if __name__ == "__main__":
    main()
