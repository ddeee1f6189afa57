"""Plain decoding's speed on the tuning decoder (packed target, every drafter kind of the space on
standby, no tuner) against a plain decoder, on the same prompts, interleaved, two passes: whether
keeping the drafters on standby costs plain rounds anything, and how far this machine's speed
drifts between passes. Each line also gives the request's prefill (the time to its first token).

    python tools/plain_rounds.py --task mt-bench --limit 4 --max-new-tokens 96
    python tools/plain_rounds.py --task gsm8k --offset 24 --limit 1 --precision gguf --passes 3
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune.cli.args import add_model_args, add_prompt_args  # noqa: E402
from autotune.tuning.study import space_context, standby_strategies, verify_width  # noqa: E402
from runtime.decoding import GenerationConfig  # noqa: E402
from runtime.pipeline import ModelPool, build_decoder, eos_ids  # noqa: E402
from runtime.precision import PRECISIONS  # noqa: E402
from search_spaces.spaces import get_space  # noqa: E402
from search_spaces.strategy import PLAIN  # noqa: E402
from studies import load_prompts  # noqa: E402
from studies.encode import encode_prompt  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap, ["model", "draft"], model={"required": False, "default": "qwen2.5-coder-1.5b"},
                   draft={"default": "qwen2.5-coder-0.5b"})
    add_prompt_args(ap, ["task", "limit", "max_new_tokens"], task={"default": "mt-bench"}, limit={"default": 4},
                    max_new_tokens={"default": 96})
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--offset", type=int, default=0, help="the task's first prompt")
    ap.add_argument("--precision", default="float32", choices=sorted(PRECISIONS),
                    help="the target's precision (the draft stays float32)")
    args = ap.parse_args()

    pool = ModelPool()
    target = pool.get(args.model, args.precision)
    prompts = [encode_prompt(item, target.tokenizer)
               for item in load_prompts(args.task, limit=args.limit, offset=args.offset)]
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, eos_token_ids=eos_ids(target))
    space = get_space("auto")
    ctx = space_context(space, target, pool.get(args.draft, "float32"), 0.45)
    decoders = {
        "plain decoder": build_decoder(pool, target, PLAIN),
        "tuning decoder": build_decoder(pool, target, PLAIN, args.draft, verify_width=verify_width(space, ctx),
                                        standby=standby_strategies(space, ctx)),
    }
    warm = GenerationConfig(max_new_tokens=8, eos_token_ids=cfg.eos_token_ids)
    for dec in decoders.values():
        dec.generate(prompts[0], warm)
    totals = {name: [0, 0.0] for name in decoders}
    for p in range(args.passes):
        for ids in prompts:
            for name, dec in decoders.items():
                s = dec.generate(ids, cfg).stats
                rounds_s = s.wall_s - s.prefill_s
                totals[name][0] += s.new_tokens - 1
                totals[name][1] += rounds_s
                print(f"pass {p + 1} {name:>14}: {(s.new_tokens - 1) / rounds_s:.2f} tok/s (decode rounds), "
                      f"prefill {s.prefill_s:.2f} s")
    for name, (n, secs) in totals.items():
        print(f"{name:>14}: {n / secs:.2f} tok/s over {n} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
