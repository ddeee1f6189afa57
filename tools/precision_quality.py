"""How close each precision's model is to the float32 target: top-1 agreement on the float32
target's own greedy continuations of the bench prompts (teacher-forced: each precision predicts
every next token of the same text), and perplexity of the tasks' reference answers (HumanEval
canonical solutions, GSM8K reference answers) after their prompts. Prints a markdown table.

    python tools/precision_quality.py --model qwen2.5-coder-1.5b --limit 5 --max-new-tokens 128
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from autotune.cli.args import add_model_args, add_prompt_args  # noqa: E402
from runtime.decoding import GenerationConfig  # noqa: E402
from runtime.pipeline import ModelPool, build_decoder, eos_ids  # noqa: E402
from search_spaces.strategy import PLAIN  # noqa: E402
from studies import load_prompts  # noqa: E402
from studies.encode import encode_prompt  # noqa: E402

TASKS = ("humaneval", "gsm8k")


def next_logits(lm, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """Logits predicting each token of ``continuation`` after ``prompt``, float32 ``[len, V]``: the
    prompt as a prefill, the continuation as one more forward, whose rows a quantised model computes
    exactly as its decode steps do (its prefill may run other kernels: ``runtime.linear.bf16_prefill``)."""
    cache = lm.new_cache(len(prompt) + len(continuation) + 1)
    with torch.inference_mode():
        first = lm(torch.tensor(prompt, device=lm.device), cache, logits_for=slice(-1, None))
        if len(continuation) < 2:
            return first.float()
        rest = lm(torch.tensor(continuation[:-1], device=lm.device), cache)
        return torch.cat([first, rest]).float()


def agreement(lm, prompt: list[int], continuation: list[int]) -> tuple[int, int]:
    """(tokens whose argmax equals the float32 target's greedy token, tokens)."""
    logits = next_logits(lm, prompt, continuation)
    return int((logits.argmax(-1) == torch.tensor(continuation)).sum()), len(continuation)


def nll(lm, prompt: list[int], reference: list[int]) -> tuple[float, int]:
    """(summed negative log-likelihood of ``reference`` after ``prompt``, its tokens)."""
    logits = next_logits(lm, prompt, reference)
    logp = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(reference)[:, None])
    return float(-logp.sum()), len(reference)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap, ["model"], model={"required": False, "default": "qwen2.5-coder-1.5b"})
    add_prompt_args(ap, ["limit", "max_new_tokens"], limit={"default": 5})
    ap.add_argument("--precisions", default="float32,bfloat16,int8,int4,w8a8")
    args = ap.parse_args()

    pool = ModelPool()
    base = pool.get(args.model, "float32")
    tok = base.tokenizer
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, eos_token_ids=eos_ids(base))
    items = [(task, p) for task in TASKS for p in load_prompts(task, limit=args.limit)]
    prompts = [encode_prompt(p, tok) for _, p in items]
    greedy = build_decoder(pool, base, PLAIN)
    continuations = [greedy.generate(ids, cfg).tokens for ids in prompts]
    refs = {task: [(ids, tok(p.reference, add_special_tokens=False)["input_ids"])
                   for (t, p), ids in zip(items, prompts) if t == task and p.reference]
            for task in TASKS}
    print(f"| precision | top-1 agreement with float32 | {' | '.join(f'perplexity {t}' for t in TASKS)} |")
    print("|---|---|" + "---|" * len(TASKS))
    for name in args.precisions.split(","):
        lm = build_decoder(pool, pool.get(args.model, name), PLAIN).target
        same = [agreement(lm, ids, cont) for ids, cont in zip(prompts, continuations)]
        rate = sum(s for s, _ in same) / sum(n for _, n in same)
        ppl = []
        for task in TASKS:
            parts = [nll(lm, ids, ref) for ids, ref in refs[task]]
            ppl.append(math.exp(sum(s for s, _ in parts) / sum(n for _, n in parts)) if parts else float("nan"))
        print(f"| {name} | {rate:.4f} | {' | '.join(f'{x:.3f}' for x in ppl)} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
