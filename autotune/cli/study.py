"""``autotune study``: decode a task while tuning the strategy online, store the best, print the
study's summary (and with --plot, its plots)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from autotune.cli.args import add_model_args, add_prompt_args, field_default
from autotune.cli.inputs import check_common, fitting_prompts, prompt_items
from autotune.errors import CliError
from autotune.reports.study_table import format_study


def add_parser(sub: Any) -> None:
    from autotune.tuning.tuner_state import TunerSettings
    from search_spaces.spaces import SpaceContext

    def tuner(name: str) -> Any:
        return field_default(TunerSettings, name)

    p = sub.add_parser("study", help="decode a task while tuning the strategy online; store the best")
    add_model_args(p, ["model", "draft", "precision", "device"],
                   model={"required": False,
                          "help": "target (default: the packaged qwen2.5-coder-1.5b with its 0.5b draft)"},
                   draft={"help": "draft model of the same family (default space then: easyspec)"},
                   precision={"help": None})
    add_prompt_args(p, ["task", "data", "limit", "offset", "max_new_tokens"],
                    task={"help": "task name: gsm8k, humaneval (default), mt-bench, prompts"},
                    limit={"default": 10}, offset={"help": None})
    p.add_argument("--storage", help="SQLAlchemy URL (default: $AUTOTUNE_STORAGE or a SQLite file in the user data dir)")
    p.add_argument("--space", help="search space: auto (default: plain / prompt lookup / the draft model, or the "
                   "target skipping layers without --draft), layer-skip, layer-skip-free, easyspec, draft, lookup")
    p.add_argument("--trials", type=int, default=tuner("max_trials"),
                   help="stop tuning after this many trials (S; default %(default)s)")
    p.add_argument("--patience", type=int, default=tuner("patience"),
                   help="stop after this many trials without a new racer (default %(default)s)")
    p.add_argument("--window", type=int, default=tuner("window"),
                   help="generated tokens each candidate is scored on (gamma; default %(default)s)")
    p.add_argument("--beta", type=int, default=tuner("beta"),
                   help="every beta-th sampled (not enqueued) trial is Bayesian (default %(default)s)")
    p.add_argument("--stop-matchness", type=float, default=tuner("match_threshold"),
                   help="stop tuning once the best matchness reaches this (0..1]; default: never")
    p.add_argument("--max-share", type=float, default=tuner("max_share"),
                   help="cap on tuning time as a share of decode time (default %(default)s)")
    p.add_argument("--skip-ratio", type=float, default=field_default(SpaceContext, "skip_ratio"),
                   help="SWIFT skip ratio of the layer-skip space (default %(default)s)")
    p.add_argument("--seed", type=int, default=tuner("seed"))
    p.add_argument("--json", dest="json_out", type=Path, help="write the study report to this file")
    p.add_argument("--plot", type=Path, metavar="DIR", help="write the study's plots and an index.html into DIR")
    p.add_argument("--baseline", action="store_true",
                   help="also decode every prompt plainly, next to tuning on it (before, then after, "
                        "alternately): tok/s while tuning against plain decoding on the same prompts, and every "
                        "output checked identical (doubles the time)")


def run(args: argparse.Namespace) -> int:
    _study_defaults(args)
    check_common(args)
    space, settings = _space_and_settings(args)  # an unknown space fails before any load
    report = _run_study(args, space, settings)
    print(format_study(report))
    if report.refused:  # one line on stderr: the lossless check failed and nothing lossy was kept
        print(f"autotune: refused to store a tuned strategy: its output differed from plain decoding on "
              f"the prompts checked; kept plain decoding for {args.model} / {args.task}", file=sys.stderr)
    if args.json_out:
        from autotune.measure.bench import write_report

        write_report(report.as_dict(), args.json_out)
    if args.plot:
        print(f"plots: {_plot(args.storage, report.name, args.plot)}")
    return 1 if report.refused else 0


def _study_defaults(args: argparse.Namespace) -> None:
    """No --model: the embedded default pair (and its draft unless --draft is given); no --task: humaneval."""
    from autotune.tuning.study import DEFAULT_DRAFT, DEFAULT_MODEL, DEFAULT_TASK

    if args.model is None:
        args.model, args.draft = DEFAULT_MODEL, args.draft or DEFAULT_DRAFT
    args.task = args.task or DEFAULT_TASK


def _space_and_settings(args: argparse.Namespace) -> tuple[Any, Any]:
    """The search space (checked against --draft) and the tuner settings the flags give."""
    from autotune.tuning.study import check_space_choice, default_space
    from autotune.tuning.tuner_state import TunerSettings
    from search_spaces.spaces import get_space

    space = get_space(args.space or default_space(args.draft))
    check_space_choice(space, args.draft)
    if not 0.0 <= args.skip_ratio < 1.0:
        raise CliError(f"--skip-ratio must be in [0, 1), got {args.skip_ratio}")
    return space, TunerSettings(window=args.window, beta=args.beta, max_trials=args.trials, patience=args.patience,
                                seed=args.seed, match_threshold=args.stop_matchness, max_share=args.max_share)


def _run_study(args: argparse.Namespace, space: Any, settings: Any) -> Any:
    from autotune.store.storage import open_storage
    from autotune.tuning.study import run_study
    from runtime.pipeline import ModelPool, default_draft
    from studies import routing_text

    items = prompt_items(args)
    with open_storage(args.storage) as storage:  # an unreachable store fails before any load
        pool = ModelPool(device=args.device)
        target = pool.get(args.model, args.precision)
        if args.draft:
            from runtime.loading import check_vocab_compatible

            check_vocab_compatible(target, default_draft(pool, args.draft))
        prompts, cfg = fitting_prompts(args, pool, target, items)
        return run_study(
            pool, target, args.draft, args.task, [ids for _, ids in prompts], cfg, storage, space.name, settings,
            skip_ratio=args.skip_ratio, prompt_texts=[routing_text(item) for item in items], baseline=args.baseline,
        )


def _plot(storage_url: str | None, name: str, out_dir: Path) -> Path:
    """Open the store at ``storage_url`` and write study ``name``'s report into ``out_dir``."""
    from autotune.reports.study_report import plot_loaded
    from autotune.store.storage import open_storage

    with open_storage(storage_url) as storage:
        return plot_loaded(storage.optuna_storage(), name, out_dir)
