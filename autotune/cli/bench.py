"""``autotune bench``: decoding methods side by side on one task (or on synthetic prompts for
random-weight models), with the speedup over the baseline and every output checked against it."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from autotune.cli.args import add_model_args, add_prompt_args, add_strategy_args, field_default
from autotune.cli.inputs import (
    check_common, check_prompts_fit, fitting_prompts, generation_config, load_models, prompt_items,
)
from autotune.errors import CliError

METHODS_HELP = (
    "comma list of: hf, hf-static, hf-assisted, vanilla, sd, sd-tree, lookup, easyspec, selfspec, uniform (the "
    "untuned start of `study`), tuned (the stored best), llamacpp, llamacpp-draft, llamacpp-lookup (llama.cpp on the "
    "same GGUF files, built by `make peers`); options after colons, e.g. easyspec:lp2:nocal, selfspec:r0.3, "
    "tuned:task=gsm8k, llamacpp-draft:k8"
)


def add_parser(sub: Any) -> None:
    from autotune.measure.bench import BenchContext

    p = sub.add_parser("bench", help="compare decoding methods side by side on one task")
    add_model_args(p)
    add_prompt_args(p, ["task", "data", "limit", "offset", "max_new_tokens"])
    add_strategy_args(p)
    p.add_argument(
        "--random-weights", action="store_true",
        help="build the models from their configs with random weights and run synthetic prompts (costs are real, "
        "tokens meaningless: a GPU machine without the weights); no --task",
    )
    p.add_argument("--prompt-len", type=int, default=128, help="tokens per synthetic prompt (--random-weights)")
    p.add_argument("--methods", default="hf,vanilla,sd", help=METHODS_HELP)
    p.add_argument("--storage", help="strategy store URL for method tuned (default: $AUTOTUNE_STORAGE or local SQLite)")
    p.add_argument(
        "--shared-width", action="store_true",
        help="pad every speculative method's verify pass to the widest one (one packed target copy in RAM)",
    )
    p.add_argument("--lp-size", type=int, default=field_default(BenchContext, "lp_size"),
                   help="EasySpec layer-parallel size for method easyspec (default %(default)s)")
    p.add_argument("--skip-ratio", type=float, default=field_default(BenchContext, "skip_ratio"),
                   help="SWIFT uniform skip ratio for method selfspec (default %(default)s)")
    p.add_argument("--json", dest="json_out", type=Path, help="write the report to this file")
    p.add_argument("--plot", type=Path, metavar="FILE", help="draw the methods side by side into this PNG")


def run(args: argparse.Namespace) -> int:
    from autotune.measure.bench import SHARED_WIDTH, BenchContext, format_table, parse_methods, run_bench, write_report
    from autotune.measure.peers import check_methods_ready

    check_common(args)
    methods = parse_methods(args.methods)
    check_methods_ready([m.name for m in methods], args.model, args.draft, args.random_weights)
    items = _bench_items(args)
    _check_tuned_stored(args, methods)
    pool, target, strategy = load_models(args)
    if args.random_weights:
        prompts, cfg = _synthetic_prompts(args, pool, target)
    else:
        prompts, cfg = fitting_prompts(args, pool, target, items)
    ctx = BenchContext(
        pool=pool, target=target, draft_name=args.draft, dtype=args.precision, strategy=strategy,
        lp_size=args.lp_size, skip_ratio=args.skip_ratio, task=args.task, storage=args.storage,
        verify_width=SHARED_WIDTH if args.shared_width else None,
    )
    report = run_bench(ctx, methods, [ids for _, ids in prompts], cfg)
    report["config"] = {
        "model": target.model_id, "draft": args.draft, "task": args.task, "limit": len(prompts),
        "max_new_tokens": args.max_new_tokens, "dtype": args.precision, "strategy": strategy.to_dict(),
        "compile": args.compile, "random_weights": args.random_weights,
        "threads": __import__("torch").get_num_threads(),
    }
    print(format_table(report))
    if args.json_out:
        write_report(report, args.json_out)
    if args.plot:
        from autotune.reports.plots import bench_plot

        bench_plot(report, args.plot)
    return 0


def _bench_items(args: argparse.Namespace) -> list[Any]:
    """The task's prompts; none with --random-weights (synthetic prompts come after the load)."""
    if args.random_weights:
        if args.task:
            raise CliError("--random-weights runs synthetic prompts (random models have no tokenizer); drop --task")
        if args.prompt_len < 1:
            raise CliError(f"--prompt-len must be at least 1, got {args.prompt_len}")
        return []
    if not args.task:
        raise CliError("bench needs --task NAME (or --random-weights for synthetic prompts on random weights)")
    return prompt_items(args)


def _check_tuned_stored(args: argparse.Namespace, methods: list[Any]) -> None:
    """Method ``tuned`` needs a stored strategy: a missing one fails before any model loads."""
    from autotune.store.resolve import BEST, check_strategy_spec

    for spec in methods:
        if spec.name == "tuned":
            options = dict(spec.options)
            db = options.get("db")
            storage = f"sqlite:///{Path(db).resolve()}" if db else args.storage
            check_strategy_spec(BEST, storage, args.model, args.draft, options.get("task", args.task), args.device)


def _synthetic_prompts(args: argparse.Namespace, pool: Any, target: Any) -> tuple[list[Any], Any]:
    """``--limit`` seeded random prompts of ``--prompt-len`` ids for random-weight models, decoded
    without EOS (every method runs the full budget: only the costs mean anything)."""
    import torch

    cfg = generation_config(args, ())
    vocab = target.hf_model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [(f"random-{i}", torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist())
               for i in range(args.limit or 5)]
    check_prompts_fit(pool, target, prompts, cfg)
    return prompts, cfg
