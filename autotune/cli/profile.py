"""``autotune profile``: time our runtime's plain, verify-by-width and draft-by-plan steps."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from autotune.cli.args import add_model_args, field_default, int_list
from autotune.errors import CliError


def add_parser(sub: Any) -> None:
    from autotune.measure.profile_settings import ProfileSettings

    def csv(name: str) -> str:
        return ",".join(map(str, field_default(ProfileSettings, name)))

    p = sub.add_parser("profile", help="time our runtime's plain, verify-by-width and draft-by-plan steps")
    add_model_args(p, ["model", "draft", "device", "precision"],
                   draft={"help": "draft model (default: the target drafts for itself)"},
                   precision={"default": "auto",
                              "help": "precision(s) to time, comma-separated, e.g. float32,int4,w8a8,gguf (default: auto, "
                                      "measured on CPU, bfloat16 on CUDA); one table each, then a comparison by rows"})
    p.add_argument("--random-weights", action="store_true",
                   help="build the models from their configs with random weights (no weights needed)")
    p.add_argument("--widths", default=csv("widths"), help="verify widths (rows) to time, e.g. 1,8 (default: %(default)s)")
    p.add_argument("--lp-size", default=csv("lp_sizes"),
                   help="EasySpec layer-parallel sizes for the draft step, e.g. 4 (default: %(default)s)")
    p.add_argument("--min-time", type=float, default=field_default(ProfileSettings, "min_run_time"),
                   help="seconds to time each step for, at least (default: %(default)s)")
    add_model_args(p, ["compile"], compile={"help": "time compiled steps (torch.compile; CUDA graphs on CUDA)"})
    p.add_argument("--json", dest="json_out", type=Path, help="write the report to this file")


def run(args: argparse.Namespace) -> int:
    from autotune.measure.bench import write_report
    from autotune.measure.profile import format_comparison, format_table, run_profile
    from autotune.measure.profile_settings import ProfileSettings

    given = {"widths": ("--widths", args.widths), "lp_sizes": ("--lp-size", args.lp_size)}
    sizes = {k: tuple(int_list(flag, text)) for k, (flag, text) in given.items() if text}
    settings = ProfileSettings(**sizes, min_run_time=args.min_time, compile=args.compile)
    from runtime.pipeline import ModelPool

    names = [name.strip() for name in args.precision.split(",") if name.strip()]
    if not names:
        raise CliError(f"--precision takes one or more precisions like int4 or float32,int4, got {args.precision!r}")
    pool = ModelPool(device=args.device, random_weights=args.random_weights)
    reports = []
    for name in names:
        reports.append(run_profile(args.model, args.draft, args.device, name, args.random_weights, settings, pool))
        print(format_table(reports[-1]))
    if len(reports) > 1:
        print(format_comparison(reports))
    if args.json_out:
        write_report(reports[0] if len(reports) == 1 else {"precisions": reports}, args.json_out)
    return 0
