"""Does drafting pay in a batch on this machine? (docs/benchmarks.md, issue 28, stop 46.)

Decode a batch of the ``mixed`` stream's requests together (``runtime.batching.generate_batch``,
the server's batched step) with the server's default draft chain, every step's draft capped at k
tokens (k = 0: plain rows), and print tokens/s per cap, with the drafting and verify time, plus the
draft model's depth forward timed for 1, 2, 4, 8 and 16 sequences (what ``DraftCost`` fits).

    python tools/batch_draft_caps.py [--batch 4] [--caps 0,1,2,3,0] [--tokens 64]
"""
from __future__ import annotations

import argparse
import time

from autotune.measure.loadtest import interleaved
from autotune.measure.steps import time_steps
from runtime.batching import BatchRequest, generate_batch
from runtime.decoding import GenerationConfig
from runtime.pipeline import ModelPool, build_decoder, eos_ids, verify_packing
from search_spaces.strategy import Strategy
from studies import encode_prompt
from studies.stream import load_stream


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--precision", default="float32")
    ap.add_argument("--width", type=int, default=13, help="the server's verify width")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--caps", default="0,1,2,3,0")
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    pool = ModelPool(device="cpu")
    target = pool.get(args.model, args.precision)
    lm = pool.served(target)
    backend = verify_packing(lm, "cpu")
    batch_lm = pool.target_for_width(target, backend, args.width) if backend is not None else lm
    requests = [r for r in interleaved(load_stream("mixed")) if r.category not in ("gsm8k", "xsum")][: args.batch]
    prompts = [encode_prompt(r.prompt, target.tokenizer) for r in requests]
    print("requests:", ", ".join(f"{r.category} ({len(p)} tokens)" for r, p in zip(requests, prompts)), flush=True)
    config = GenerationConfig(max_new_tokens=args.tokens, eos_token_ids=eos_ids(target))
    for cap in (int(c) for c in args.caps.split(",")):
        decoders = [build_decoder(pool, target, Strategy(), args.draft, verify_width=args.width) for _ in prompts]
        for d in decoders:
            d.step_cap = cap
        started = time.perf_counter()
        results = generate_batch(batch_lm, [BatchRequest(d, p, config) for d, p in zip(decoders, prompts)])
        wall = time.perf_counter() - started
        tokens = sum(len(r.tokens) for r in results)
        print(f"cap {cap}: {tokens} tokens in {wall:.2f} s = {tokens / wall:.2f} tok/s (prefills "
              f"{sum(r.stats.prefill_s for r in results):.2f} s of it); drafted {sum(r.stats.drafted for r in results)}, "
              f"accepted {sum(r.stats.accepted for r in results)}", flush=True)
    draft = decoders[0].drafter_of("draft-model").model
    timed = time_steps(draft, [(b, b) for b in (1, 2, 4, 8, 16)], repeats=3)
    print("draft depth forward: " + ", ".join(f"{s} sequences {t * 1e3:.1f} ms" for _, s, t in timed))


if __name__ == "__main__":
    main()
