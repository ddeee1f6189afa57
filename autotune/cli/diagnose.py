"""``autotune diagnose``: EasySpec table 5, the cosine similarity of exact vs. fuzzy attention states."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from autotune.cli.args import add_model_args, add_prompt_args, int_list
from autotune.cli.inputs import prompt_items, tokenize
from autotune.errors import CliError


def add_parser(sub: Any) -> None:
    p = sub.add_parser("diagnose", help="EasySpec table 5: cosine similarity of exact vs. fuzzy attention states")
    add_model_args(p, ["model", "precision", "device"], model={"help": "model: alias, local directory or hub id"},
                   precision={"help": None})
    add_prompt_args(p, ["prompt", "task", "data", "limit", "offset"], limit={"help": "prompts of the task to run"})
    p.add_argument("--lp-size", default="2,3,4", help="comma list of layer-parallel sizes (each >= 2)")
    p.add_argument("--json", dest="json_out", type=Path, help="write the report to this file")


def run(args: argparse.Namespace) -> int:
    from autotune.measure.diagnose import diagnose, format_table
    from runtime.pipeline import ModelPool
    from runtime.transformer import CausalLM

    lp_sizes = int_list("--lp-size", args.lp_size)
    bad = [lp for lp in lp_sizes if lp < 2]
    if bad:
        raise CliError(f"--lp-size values must be at least 2 (layer-parallel groups), got {bad[0]}")
    if args.limit < 1:
        raise CliError(f"--limit must be at least 1, got {args.limit}")
    items = prompt_items(args)
    pool = ModelPool(device=args.device)
    model = pool.get(args.model, args.precision)
    if model.blocks_only:  # states are compared on the float tree (dense layer loop)
        model = pool.get(args.model, "float32")
    prompts = tokenize(items, model.tokenizer)
    report = diagnose(CausalLM(model.hf_model), [ids for _, ids in prompts], lp_sizes)
    report["config"] = {"model": model.model_id, "task": args.task, "prompt_ids": [pid for pid, _ in prompts],
                        "dtype": args.precision}
    print(format_table(report, title=args.model))
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=2))
    return 0
