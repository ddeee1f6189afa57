"""``autotune generate``: decode prompts (speculatively when --draft is given) and print the text."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from autotune.cli.args import add_model_args, add_prompt_args, add_strategy_args, field_default
from autotune.cli.inputs import (
    check_common, check_strategy_choice, generation_config, load_models, prompt_items, tokenize,
)


def add_parser(sub: Any) -> None:
    from runtime.decoding import GenerationConfig
    from runtime.sampling import SamplingParams

    p = sub.add_parser("generate", help="generate text (speculatively when --draft is given)")
    add_model_args(p)
    add_prompt_args(p, limit={"default": None})
    add_strategy_args(p)
    p.add_argument("--temperature", type=float, default=field_default(SamplingParams, "temperature"),
                   help="0 decodes greedily (default %(default)s)")
    p.add_argument("--top-p", type=float, default=field_default(SamplingParams, "top_p"),
                   help="nucleus sampling; 1 disables (default %(default)s)")
    p.add_argument("--top-k", type=int, default=field_default(SamplingParams, "top_k"),
                   help="keep the k most likely tokens; 0 disables (default %(default)s)")
    p.add_argument("--seed", type=int, default=field_default(GenerationConfig, "seed"))
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.add_argument(
        "--strategy", help="best (stored for this model, draft, task and hardware), default, or a strategy JSON file"
    )
    p.add_argument("--storage", help="strategy store URL (default: $AUTOTUNE_STORAGE or a local SQLite file)")
    p.add_argument("--adapt", action="store_true",
                   help="start each prompt with the strategy, then switch between rounds to what the prompt's own "
                        "tokens show is fastest (plain, prompt lookup, a shorter chain) and stop speculating where it "
                        "measured slower than plain; the output is the same tokens either way")


def run(args: argparse.Namespace) -> int:
    import torch

    from autotune.tuning.controller import ControlSettings, controller_cost, generate_controlled, lookup_candidate
    from autotune.tuning.corrections import Corrections
    from runtime.pipeline import build_decoder, eos_ids

    check_common(args)
    generation_config(args, ())  # validate sampling flags before loading anything
    items = prompt_items(args)
    check_strategy_choice(args)
    pool, target, strategy = load_models(args)
    prompts = tokenize(items, target.tokenizer)
    cfg = generation_config(args, eos_ids(target))
    control = ControlSettings() if args.adapt else None
    standby = []
    if control is not None and strategy.drafter != "prompt-lookup":
        look = lookup_candidate(control.lookup_length, max(strategy.max_tree_nodes, control.lookup_length) + 1)
        standby = [look] if look is not None else []
    decoder = build_decoder(pool, target, strategy, args.draft, standby=standby)
    for pid, ids in prompts:
        decoder.check_fits(len(ids), cfg)
    cost, corrections = (controller_cost(decoder), Corrections()) if control is not None else (None, None)
    if cost is not None:  # timed before decoding, as a server does at start-up: not inside a request's scoring
        with torch.inference_mode():
            cost.prepare()
    for pid, ids in prompts:
        summary = None
        if control is not None:
            result, ctl = generate_controlled(decoder, ids, cfg, strategy, cost, control, corrections)
            summary = ctl.summary(decode_s=result.stats.wall_s - result.stats.prefill_s)
        else:
            result = decoder.generate(ids, cfg)
        text = target.tokenizer.decode(result.tokens, skip_special_tokens=True)
        if args.json:
            row = {"id": pid, "text": text, "tokens": result.tokens, "stats": result.stats.as_dict()}
            if summary is not None:
                row["control"] = summary
            print(json.dumps(row))
        else:
            s = result.stats
            print(text)
            adapted = f", {summary['prior']} -> {summary['final']} ({summary['switches']} switches)" if summary else ""
            print(f"[{pid}] {s.new_tokens} tokens, {s.tokens_per_s:.2f} tok/s, alpha {s.acceptance_rate:.2f}, "
                  f"M {s.mean_accepted:.2f}{adapted}", file=sys.stderr)
    return 0
