"""The checks behind docs/benchmarks.md's "GPU: first measurements" (random weights: the packaged
GGUF files do not travel to a lent GPU machine, so every model is built from its config).

    python tools/gpu_checks.py kernels                  # which quantised CPU kernels also run on CUDA
    python tools/gpu_checks.py agreement --model qwen2.5-coder-0.5b --tokens 64 [--compile]
                                                        # speculative modes against plain decoding

``kernels`` calls torch's weight-only int4 / int8 ops and ``torch._int_mm`` on the device and
prints which run (``runtime.precision`` allows int4 / int8 / w8a8 only on the CPU).

``agreement`` decodes one seeded random prompt plainly and with prompt lookup, a draft chain and a
draft tree (the draft is the target itself, so drafts are accepted and verifies are wide) at
float32 and bfloat16, and prints per mode whether the tokens equal plain decoding's, where they
first part, what was drafted and accepted, and tokens/s. docs/design.md: bf16 on a GPU is not
batch-invariant, so identity is not claimed there; agreement is reported.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

from autotune.measure.peers import agreement as agreed
from runtime.decoding import GenerationConfig
from runtime.pipeline import ModelPool, build_decoder
from search_spaces.strategy import PLAIN, Strategy


def kernels(device: str) -> None:
    dev = torch.device(device)
    x = torch.randn(4, 1536, device=dev, dtype=torch.bfloat16)
    w = torch.randint(-8, 8, (512, 1536), device=dev, dtype=torch.int32)

    def int4() -> torch.Tensor:
        packed_u8 = ((w[:, ::2] + 8) << 4 | (w[:, 1::2] + 8)).to(torch.uint8)
        packed = torch.ops.aten._convert_weight_to_int4pack(packed_u8, 8)
        sz = torch.ones(1536 // 128, 512, 2, device=dev, dtype=torch.bfloat16)
        return torch.ops.aten._weight_int4pack_mm(x, packed, 128, sz)

    def int8() -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, w.to(torch.int8), torch.ones(512, device=dev, dtype=torch.bfloat16))

    def int_mm() -> torch.Tensor:
        a = torch.randint(-8, 8, (32, 1536), device=dev, dtype=torch.int8)
        return torch._int_mm(a, w.to(torch.int8).t())  # (K, N), column-major

    for name, fn in (("int4 weight-only (_weight_int4pack_mm)", int4), ("int8 weight-only (_weight_int8pack_mm)", int8),
                     ("w8a8 (torch._int_mm)", int_mm)):
        try:
            out = fn()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            print(f"{name}: runs on {dev.type} (out {tuple(out.shape)} {out.dtype})", flush=True)
        except Exception as exc:  # noqa: BLE001 - the point is to report what fails
            print(f"{name}: fails on {dev.type}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}", flush=True)


MODES: dict[str, Strategy] = {
    "lookup k=8": Strategy(drafter="prompt-lookup", draft_length=8),
    "chain k=4 (self draft)": Strategy(draft_length=4, confidence_threshold=0.0),
    "tree 2-2-1 (self draft)": Strategy(draft_length=3, confidence_threshold=0.0, tree_widths=(2, 2, 1)),
}


def agreement(model: str, device: str, tokens: int, compile_steps: bool, dtypes: list[str]) -> None:
    gen = torch.Generator().manual_seed(0)
    for dtype in dtypes:
        pool = ModelPool(device=device, compile=compile_steps, random_weights=True)
        target = pool.get(model, dtype)
        prompt = torch.randint(0, target.hf_model.config.vocab_size, (64,), generator=gen).tolist()
        cfg = GenerationConfig(max_new_tokens=tokens)
        rows = []
        reference = None
        for label, strategy in (("plain", PLAIN), *MODES.items()):
            if strategy.drafter == "draft-model":
                strategy = replace(strategy, draft_precision=dtype)
            draft = model if strategy.drafter == "draft-model" else None
            try:
                dec = build_decoder(pool, target, strategy, draft)
                dec.generate(prompt, GenerationConfig(max_new_tokens=8))  # warm-up: compiles its steps
                started = time.perf_counter()
                result = dec.generate(prompt, cfg)
                wall = time.perf_counter() - started
            except Exception as exc:  # noqa: BLE001 - report and go on with the other modes
                rows.append(f"| {dtype} | {label} | failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]} |")
                continue
            out = list(result.tokens)
            if reference is None:
                reference = out
            first, longer = agreed(reference, out)
            s = result.stats
            rows.append(f"| {dtype} | {label} | {'yes' if out == reference else 'no'} | {first / max(longer, 1):.3f} "
                        f"({first} of {longer}) | {s.drafted} | {s.accepted} | {len(out) / wall:.1f} |")
        print(f"\n{model} (random weights), {device}, compiled: {compile_steps}, {tokens} tokens\n"
              "| dtype | mode | identical to plain | agreement (tokens before the first difference) | drafted | "
              "accepted | tok/s |\n|---|---|---|---|---|---|---|", flush=True)
        print("\n".join(rows), flush=True)
        del pool, target
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="check", required=True)
    k = sub.add_parser("kernels")
    k.add_argument("--device", default="cuda")
    a = sub.add_parser("agreement")
    a.add_argument("--model", default="qwen2.5-coder-0.5b")
    a.add_argument("--device", default="cuda")
    a.add_argument("--tokens", type=int, default=64)
    a.add_argument("--compile", action="store_true")
    a.add_argument("--dtypes", default="float32,bfloat16")
    args = ap.parse_args()
    if args.check == "kernels":
        kernels(args.device)
    else:
        with torch.inference_mode():
            agreement(args.model, args.device, args.tokens, args.compile, args.dtypes.split(","))


if __name__ == "__main__":
    main()
