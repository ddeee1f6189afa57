"""``autotune study``: decode a task while tuning the strategy online, store the best, print the
study's summary (and with --plot, its plots)."""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from autotune.cli.args import add_model_args, add_prompt_args
from autotune.cli.inputs import check_common, fitting_prompts, prompt_items
from autotune.errors import CliError


def add_parser(sub: Any) -> None:
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
    p.add_argument("--trials", type=int, help="stop tuning after this many trials (S; default 1000)")
    p.add_argument("--patience", type=int, help="stop after this many trials without a new racer (default 300)")
    p.add_argument("--window", type=int, help="generated tokens each candidate is scored on (gamma; default 32)")
    p.add_argument("--beta", type=int, help="every beta-th sampled (not enqueued) trial is Bayesian (default 2)")
    p.add_argument("--stop-matchness", type=float, help="stop tuning once the best matchness reaches this (0..1]")
    p.add_argument("--max-share", type=float, help="cap on tuning time as a share of decode time (default 0.02)")
    p.add_argument("--skip-ratio", type=float, default=0.45, help="SWIFT skip ratio of the layer-skip space")
    p.add_argument("--seed", type=int, default=0)
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
    from autotune.tuning.tuner import TunerSettings
    from search_spaces.spaces import get_space

    space = get_space(args.space or default_space(args.draft))
    check_space_choice(space, args.draft)
    if not 0.0 <= args.skip_ratio < 1.0:
        raise CliError(f"--skip-ratio must be in [0, 1), got {args.skip_ratio}")
    given = {"window": args.window, "beta": args.beta, "max_trials": args.trials, "patience": args.patience,
             "seed": args.seed, "match_threshold": args.stop_matchness, "max_share": args.max_share}
    return space, TunerSettings(**{k: v for k, v in given.items() if v is not None})  # the rest: their defaults


def _run_study(args: argparse.Namespace, space: Any, settings: Any) -> Any:
    from autotune.store.storage import open_storage
    from autotune.tuning.study import run_study
    from runtime.pipeline import ModelPool
    from studies import routing_text

    items = prompt_items(args)
    with open_storage(args.storage) as storage:  # an unreachable store fails before any load
        pool = ModelPool(device=args.device)
        target = pool.get(args.model, args.precision)
        if args.draft:
            from runtime.loading import check_vocab_compatible

            check_vocab_compatible(target, pool.get(args.draft, "float32"))
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


def format_study(report: Any) -> str:
    from rich.console import Console
    from rich.table import Table

    from autotune.tuning.heldout import describe

    t = report.tuner
    table = Table(title=f"study {report.name}", show_header=False)
    table.add_column("field")
    table.add_column("value", overflow="fold")
    plain_pred = t.get("plain_predicted_tps")
    stored = report.stored_reason
    rows = [
        ("best strategy", f"{report.best.to_json()} (the tuner's incumbent, tuned on {report.tuned_prompts} prompt(s))"),
        ("uniform (start)", report.uniform.to_json()),
        ("trials", f"{t['trials']} ({t['stop_reason']})"),
        ("best matchness", f"{t['best_matchness']:.3f}"),
        ("predicted tok/s", f"{t['best_predicted_tps']:.2f}" + (f" (plain {plain_pred:.2f})" if plain_pred else "")
         + _in_sample_text(report)),
        ("held-out speedup", _held_out_text(report)),
        ("candidates", _candidates_text(report)),
        ("predicted / measured", _ratio_text(t.get("stored") or {})),
        ("tuning share", f"{100 * report.tuning_share:.1f}% of decode time while tuning "
                         f"({t['trials']} trials, {t.get('bayes_trials', 0)} Bayesian, "
                         f"{t.get('measured_trials', 0)} measured; "
                         f"{t.get('swept', 0)} grid points swept on {t.get('windows', 0)} windows); one-time: "
                         + _costs_text(t)),
        ("while tuning", _while_tuning_text(report)),
        ("stored", f"{describe(report.chosen)}: {stored} in {report.storage_url} (history row {report.history_id})"),
        ("precision", _precision_text(report.extra.get("precision"))),
    ]
    for k, v in rows:
        table.add_row(k, v)
    console = Console(width=120, record=True)
    with console.capture() as cap:
        console.print(table)
    return cap.get()


def _costs_text(t: dict[str, Any]) -> str:
    """Where the cost model's timings came from, and what timing them cost (once per models and machine)."""
    if t.get("costs") == "kept":
        return f"cost model from the store ({t.get('calibration_s', 0.0):.1f} s timing plans first priced)"
    return f"{t.get('calibration_s', 0.0):.1f} s timing the cost model (kept in the store for the next study)"


def _in_sample_text(report: Any) -> str:
    ins = report.in_sample_speedup
    return f"; {ins:.2f}x plain in-sample (predicted on the prompts it tuned on)" if ins else ""


def _held_out_text(report: Any) -> str:
    """The stored strategy's speed-up over plain decoding on prompts the tuner never saw, and how
    much that check is worth."""
    from autotune.tuning.heldout import INTERVAL, rests_on

    v = report.verdict
    n = len(v.plain.runs)
    text = (f"{report.speedup:.2f}x ({report.chosen_tps:.2f} tok/s vs plain {report.plain_tps:.2f}, "
            f"{n} prompt(s), outputs {'identical' if report.identical else 'DIFFERENT'})")
    if v.in_sample:
        return text + "; IN-SAMPLE: one prompt, nothing held out of tuning (--limit 2 or more holds prompts out)"
    if n == 1:
        return text + "; held out of tuning, but one prompt is a weak check (--limit 10 holds out 3)"
    band = v.interval
    if band is not None and report.chosen.speculates:
        text += f"; {100 * INTERVAL:.0f}% interval {band[0]:.2f}-{band[1]:.2f}x"
    return text + f"; on prompts held out of tuning; rests on {rests_on(v)}"


def _candidates_text(report: Any) -> str:
    """Each candidate of the held-out judgement: its speed-up and its lower bound (as stored)."""
    from autotune.tuning.heldout import describe

    parts = []
    for c, d in zip(report.verdict.candidates[1:], report.verdict.as_dict()["candidates"][1:]):
        shown = f"{math.exp(d['bound']):.2f}x" if d["bound"] > -math.inf else "-"
        parts.append(f"{c.label} ({describe(c.strategy)}): {d['speedup']:.2f}x "
                     f"(bound {shown}{'' if c.identical else ', output DIFFERED'})")
    return "; ".join(parts) or "none (the tuner kept plain decoding and scored nothing else)"


def _precision_text(info: dict[str, Any] | None) -> str:
    """The precision tuned at, and the fastest one predicted for the stored strategy and for plain."""
    if not info:
        return "-"
    from runtime.auto_precision import CANDIDATES
    from runtime.precision import auto_precision

    est = {e["precision"]: e for e in info["estimates"]}
    fastest, plain = info["fastest"], info["fastest_plain"]
    text = f"tuned at {info['precision']}"
    if info["precision"] in CANDIDATES and info["precision"] == auto_precision("cpu"):  # CPU-only precisions
        text += (f" (auto on this CPU: of {', '.join(CANDIDATES)}, whose speculation is exact relative to their plain "
                 "decoding, the one whose kernels ran a plain step and an 8-row verify fastest)")
    text += (f"; predicted fastest here: {fastest} for the stored strategy ({est[fastest]['chosen_tps']:.1f} tok/s), "
             f"{plain} for plain decoding ({est[plain]['plain_tps']:.1f} tok/s)")
    if fastest != info["precision"]:
        text += f"; tune at --precision {fastest} to check"
    return text


def _while_tuning_text(report: Any) -> str:
    """Tokens/s over the study's prompts (prefill and tuning included), against plain decoding on
    the same prompts when ``--baseline`` measured it."""
    text = f"{report.tune_stats.tokens_per_s:.2f} tok/s"
    b = report.baseline
    if b is None:
        return text + " (--baseline measures plain decoding on the same prompts)"
    return (f"{text} vs plain {b.plain.tokens_per_s:.2f} on the same prompts, interleaved ({b.ratio:.2f}x); "
            f"outputs {'identical' if b.identical else 'DIFFERENT'} on every prompt")


def _ratio_text(stored: dict[str, Any]) -> str:
    """The stored strategy's prediction against its decode-round speed on the held-out prompts:
    priced on their own text (the cost model and the pricing of matches), and predicted from the
    prompts tuned on (that and how far the task's text varies)."""
    on = stored.get("on", "held-out prompts")
    parts = []
    if stored.get("ratio"):
        parts.append(f"{stored['ratio']:.2f} (predicted {stored['predicted_tps']:.2f} tok/s on the {on}' own text, "
                     f"decode rounds measured {stored['decode_tps']:.2f})")
    if stored.get("task_ratio"):
        parts.append(f"{stored['task_ratio']:.2f} from the prompts tuned on ({stored['task_predicted_tps']:.2f} tok/s)")
    return "; ".join(parts) or "-"
