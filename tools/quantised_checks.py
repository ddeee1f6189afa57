"""The checks behind docs/benchmarks.md's "A lossless bug at int4, and a bf16 prefill":

    python tools/quantised_checks.py identity   # plain vs the draft chain, token for token, MT-Bench 0-3
    python tools/quantised_checks.py timings    # a step, a chain verify, a tree verify, the prefill; kernels by rows

``identity`` decodes each prompt plainly and with the 0.5B draft chain (k=10, threshold 0.6) at the
given precision and prints where they part (none: identical), with the tokens drafted. ``timings``
prints the best-of-N time of the target's forwards after a prompt, and one MLP matrix of the 1.5B at
many rows under the int4 kernel, fp32 and bf16.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from runtime.decoding import GenerationConfig  # noqa: E402
from runtime.pipeline import ModelPool, build_decoder, eos_ids  # noqa: E402
from runtime.quant import Bf16Linear, Int4WeightOnlyLinear  # noqa: E402
from runtime.tree import compile_tree, tree_tables  # noqa: E402
from search_spaces.strategy import PLAIN, Strategy  # noqa: E402
from studies import load_prompts  # noqa: E402
from studies.encode import encode_prompt  # noqa: E402


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1000


def identity(args: argparse.Namespace) -> None:
    pool = ModelPool()
    target = pool.get(args.model, args.precision)
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, eos_token_ids=eos_ids(target))
    plain = build_decoder(pool, target, PLAIN)
    chain = build_decoder(pool, target, Strategy(draft_length=10, confidence_threshold=0.6), args.draft)
    for prompt in load_prompts(args.task, None, args.limit, args.offset):
        ids = encode_prompt(prompt, target.tokenizer)
        want = plain.generate(ids, cfg).tokens
        got = chain.generate(ids, cfg)
        first = next((i for i, (a, b) in enumerate(zip(want, got.tokens)) if a != b), None)
        if first is None and len(want) != len(got.tokens):
            first = min(len(want), len(got.tokens))
        where = "identical" if first is None else f"PARTS at token {first}"
        print(f"{prompt.id}: {where} ({len(want)} tokens, {got.stats.drafted} drafted)", flush=True)


def timings(args: argparse.Namespace) -> None:
    pool = ModelPool()
    lm = pool.served(pool.get(args.model, args.precision))
    prompt = torch.randint(0, 1000, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        def prefill():
            cache = lm.new_cache(args.prompt_tokens + 64)
            lm(prompt, cache, logits_for=slice(-1, None))
            return cache

        cache = prefill()
        print(f"prefill {args.prompt_tokens} tokens: {best_ms(prefill, 2):.1f} ms")
        base = cache.length
        tree = compile_tree((-1, -1, -1, 0, 0, 1, 3, 3, 4, 6, 6, 7, 9, 9, 10))  # 15 nodes + the root: 16 rows

        def rows(n: int, as_tree: bool = False) -> Callable[[], object]:
            def run():
                cache.rollback(base)
                if as_tree:
                    tables = tree_tables(tree, "cpu")
                    return lm(prompt[:n], cache, positions=tables.offsets + base, rel_mask=tables.block)
                return lm(prompt[:n], cache)
            return run

        print(f"1-row step: {best_ms(rows(1), 5):.1f} ms")
        print(f"11-row chain verify: {best_ms(rows(11), 3):.1f} ms")
        print(f"16-row tree verify: {best_ms(rows(16, True), 3):.1f} ms")
        w = torch.randn(8960, 1536, generator=torch.Generator().manual_seed(1)) * 0.02
        int4, bf16 = Int4WeightOnlyLinear(w, None), Bf16Linear(w, None)
        for n in (16, 64, 157, 400):
            x = torch.randn(n, 1536)
            row = {name: best_ms(lambda f=f: f(x), 3) for name, f in
                   (("int4", int4), ("fp32", lambda x: torch.nn.functional.linear(x, w)), ("bf16", bf16))}
            print(f"8960x1536 at {n} rows: " + ", ".join(f"{k} {v:.1f} ms" for k, v in row.items()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("check", choices=("identity", "timings"))
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--precision", default="int4")
    ap.add_argument("--task", default="mt-bench")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--prompt-tokens", type=int, default=300)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    {"identity": identity, "timings": timings}[args.check](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
