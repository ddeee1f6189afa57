"""The ``autotune`` command line. It only parses arguments and calls the library."""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from autotune.errors import USER_ERRORS, CliError
from autotune.measure.replay import add_replay_parser, cmd_replay
from autotune.cli.report import add_report_parser, cmd_report
from autotune.serving.adaptive.settings import AdaptSettings as AdaptDefaults
from autotune.cli.strategies import add_strategies_parser, cmd_strategies


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line (exit 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="target: alias, local directory or hub id")
    p.add_argument("--draft", help="draft model of the same family (alias, directory or hub id)")
    p.add_argument("--dtype", default="float32",
                   help="target dtype: float32 (default: lossless checks), bfloat16, or auto (bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--compile", action="store_true",
                   help="compile our decode steps (torch.compile fullgraph; CUDA graphs on CUDA); first steps pay the compile")


def _add_prompt_args(p: argparse.ArgumentParser, need_task: bool, single_prompt: bool = True) -> None:
    if not need_task and single_prompt:
        p.add_argument("--prompt", help="a single prompt (chat template applied when the model has one)")
    p.add_argument("--task", required=need_task, help="task name: gsm8k, humaneval, mt-bench, prompts")
    p.add_argument("--data", help="data file or folder for the task (default: $AUTOTUNE_DATA_DIR)")
    p.add_argument("--limit", type=int, default=None if single_prompt and not need_task else 5)
    p.add_argument("--offset", type=int, default=0, help="skip this many prompts of the task")
    p.add_argument("--max-new-tokens", type=int, default=128)


def _add_strategy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft-length", type=int, help="tokens drafted per round (strategy default if unset)")
    p.add_argument("--draft-precision", help="draft arithmetic: auto, float32, bfloat16, int8 (strategy default if unset)")
    p.add_argument("--draft-vocab", type=int, help="restrict the draft head to ids < N (0 = full head)")
    p.add_argument("--confidence-threshold", type=float, help="stop drafting below this top-1 probability")
    p.add_argument("--tree-widths", help="draft a token tree: children per node at each depth, e.g. 4,2,2,1,1")
    p.add_argument("--dynamic-widths", help="SWIFT dynamic verification table: 'swift' or P:K,P:K,... (last P = 1)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="autotune", description="Auto-tuned lossless speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    gen = sub.add_parser("generate", help="generate text (speculatively when --draft is given)")
    _add_model_args(gen)
    _add_prompt_args(gen, need_task=False)
    _add_strategy_args(gen)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    gen.add_argument(
        "--strategy", help="best (stored for this model, draft, task and hardware), default, or a strategy JSON file"
    )
    gen.add_argument("--storage", help="strategy store URL (default: $AUTOTUNE_STORAGE or a local SQLite file)")
    bench = sub.add_parser("bench", help="compare decoding methods side by side on one task")
    _add_model_args(bench)
    _add_prompt_args(bench, need_task=False, single_prompt=False)
    _add_strategy_args(bench)
    bench.add_argument(
        "--random-weights", action="store_true",
        help="build the models from their configs with random weights and run synthetic prompts (costs are real, "
        "tokens meaningless: a GPU machine without the weights); no --task",
    )
    bench.add_argument("--prompt-len", type=int, default=128, help="tokens per synthetic prompt (--random-weights)")
    bench.add_argument(
        "--methods", default="hf,vanilla,sd",
        help="comma list of: hf, hf-static, hf-assisted, vanilla, sd, sd-tree, lookup, easyspec, selfspec, uniform (the "
        "untuned start of `study`), tuned (the stored best); options after colons, e.g. easyspec:lp2:nocal, "
        "selfspec:r0.3, tuned:task=gsm8k",
    )
    bench.add_argument("--storage", help="strategy store URL for method tuned (default: $AUTOTUNE_STORAGE or local SQLite)")
    bench.add_argument(
        "--shared-width", action="store_true",
        help="pad every speculative method's verify pass to the widest one (one packed target copy in RAM)",
    )
    bench.add_argument("--lp-size", type=int, default=4, help="EasySpec layer-parallel size for method easyspec")
    bench.add_argument("--skip-ratio", type=float, default=0.45, help="SWIFT uniform skip ratio for method selfspec")
    bench.add_argument("--json", dest="json_out", type=Path, help="write the report to this file")
    bench.add_argument("--plot", type=Path, metavar="FILE", help="draw the methods side by side into this PNG")
    add_strategies_parser(sub)
    add_report_parser(sub)
    add_replay_parser(sub)
    _add_profile_parser(sub)
    diag = sub.add_parser("diagnose", help="EasySpec table 5: cosine similarity of exact vs. fuzzy attention states")
    diag.add_argument("--model", required=True, help="model: alias, local directory or hub id")
    diag.add_argument("--dtype", default="float32")
    diag.add_argument("--device", default="cpu")
    diag.add_argument("--prompt", help="a single prompt (chat template applied when the model has one)")
    diag.add_argument("--task", help="task name: gsm8k, humaneval, mt-bench, prompts")
    diag.add_argument("--data", help="data file or folder for the task (default: $AUTOTUNE_DATA_DIR)")
    diag.add_argument("--limit", type=int, default=5, help="prompts of the task to run")
    diag.add_argument("--offset", type=int, default=0, help="skip this many prompts of the task")
    diag.add_argument("--lp-size", default="2,3,4", help="comma list of layer-parallel sizes (each >= 2)")
    diag.add_argument("--json", dest="json_out", type=Path, help="write the report to this file")
    study = sub.add_parser("study", help="decode a task while tuning the strategy online; store the best")
    study.add_argument("--model", help="target (default: the packaged qwen2.5-coder-1.5b with its 0.5b draft)")
    study.add_argument("--draft", help="draft model of the same family (default space then: easyspec)")
    study.add_argument("--dtype", default="float32")
    study.add_argument("--device", default="cpu")
    study.add_argument("--task", help="task name: gsm8k, humaneval (default), mt-bench, prompts")
    study.add_argument("--data", help="data file or folder for the task (default: $AUTOTUNE_DATA_DIR)")
    study.add_argument("--limit", type=int, default=10)
    study.add_argument("--offset", type=int, default=0)
    study.add_argument("--max-new-tokens", type=int, default=128)
    study.add_argument("--storage", help="SQLAlchemy URL (default: $AUTOTUNE_STORAGE or a SQLite file in the user data dir)")
    study.add_argument("--space", help="search space: auto (default: plain / prompt lookup / the draft model, or the "
                       "target skipping layers without --draft), layer-skip, layer-skip-free, easyspec, draft, lookup")
    study.add_argument("--trials", type=int, help="stop tuning after this many trials (S; default 1000)")
    study.add_argument("--patience", type=int, help="stop after this many trials without a new racer (default 300)")
    study.add_argument("--window", type=int, help="generated tokens each candidate is scored on (gamma; default 32)")
    study.add_argument("--beta", type=int, help="every beta-th trial is Bayesian (default 10)")
    study.add_argument("--stop-matchness", type=float, help="stop tuning once the best matchness reaches this (0..1]")
    study.add_argument("--max-share", type=float, help="cap on tuning time as a share of decode time (default 0.02)")
    study.add_argument("--skip-ratio", type=float, default=0.45, help="SWIFT skip ratio of the layer-skip space")
    study.add_argument("--seed", type=int, default=0)
    study.add_argument("--json", dest="json_out", type=Path, help="write the study report to this file")
    study.add_argument("--plot", type=Path, metavar="DIR", help="write the study's plots and an index.html into DIR")
    study.add_argument("--baseline", action="store_true",
                       help="also decode every prompt plainly, next to tuning on it (before, then after, "
                            "alternately): tok/s while tuning against plain decoding on the same prompts, and every "
                            "output checked identical (doubles the time)")
    serve = sub.add_parser("serve", help="an OpenAI-compatible server that routes each request to its task's strategy")
    _add_model_args(serve)
    serve.add_argument("--storage", help="strategy store URL (default: $AUTOTUNE_STORAGE or a local SQLite file)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond this get 503 + Retry-After")
    serve.add_argument("--route-distance", type=float,
                       help="cosine distance beyond which a prompt is 'unknown' (default: the measured one)")
    adapt = serve.add_argument_group("adaptive serving (drift detection, re-tuning on live traffic, new routes)")
    adapt.add_argument("--adaptive", action="store_true",
                       help="watch each route's acceptance and speed; fall back to plain and re-tune on drift")
    adapt.add_argument("--acceptance-drop", type=float, default=AdaptDefaults.acceptance_drop,
                       help="re-tune a route whose acceptance falls below (1 - this) x its stored acceptance "
                            f"(default {AdaptDefaults.acceptance_drop})")
    adapt.add_argument("--retune-requests", type=int, default=AdaptDefaults.retune_requests,
                       help=f"requests a re-tune decodes with the online tuner (default {AdaptDefaults.retune_requests})")
    adapt.add_argument("--retune-share", type=float, default=AdaptDefaults.retune_share,
                       help=f"cap on a re-tune's tuning time, as a share of its decode time "
                            f"(default {AdaptDefaults.retune_share})")
    adapt.add_argument("--new-route-requests", type=int, default=AdaptDefaults.new_route_requests,
                       help="unknown requests of one topic (a pending cluster) that become a new route "
                            f"(default {AdaptDefaults.new_route_requests})")
    adapt.add_argument("--recheck-plain-requests", type=int, default=AdaptDefaults.recheck_plain_requests,
                       help="requests a route stored as plain serves before it re-checks whether speculation "
                            f"pays (default {AdaptDefaults.recheck_plain_requests})")
    return parser


def _add_profile_parser(sub: Any) -> None:
    prof = sub.add_parser("profile", help="time our runtime's plain, verify-by-width and draft-by-plan steps")
    prof.add_argument("--model", required=True, help="target: alias, local directory or hub id")
    prof.add_argument("--draft", help="draft model (default: the target drafts for itself)")
    prof.add_argument("--device", default="cpu")
    prof.add_argument("--dtype", default="auto", help="auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16, ...")
    prof.add_argument("--random-weights", action="store_true",
                      help="build the models from their configs with random weights (no weights needed)")
    prof.add_argument("--widths", help="verify widths (rows) to time, e.g. 1,8 (default: 1 to 64 in powers of two)")
    prof.add_argument("--lp-size", help="EasySpec layer-parallel sizes for the draft step, e.g. 4 (default: 2,3,4)")
    prof.add_argument("--min-time", type=float, help="seconds to time each step for, at least (default: 0.5)")
    prof.add_argument("--compile", action="store_true", help="time compiled steps (torch.compile; CUDA graphs on CUDA)")
    prof.add_argument("--json", dest="json_out", type=Path, help="write the report to this file")


def cmd_profile(args: argparse.Namespace) -> int:
    from autotune.measure.bench import write_report
    from autotune.measure.profile import ProfileSettings, format_table, run_profile

    given = {"widths": ("--widths", args.widths), "lp_sizes": ("--lp-size", args.lp_size)}
    sizes = {k: tuple(_int_list(flag, text)) for k, (flag, text) in given.items() if text}
    timing = {"min_run_time": args.min_time} if args.min_time is not None else {}
    settings = ProfileSettings(**sizes, **timing, compile=args.compile)
    report = run_profile(args.model, args.draft, args.device, args.dtype, args.random_weights, settings)
    print(format_table(report))
    if args.json_out:
        write_report(report, args.json_out)
    return 0


def _strategy(args: argparse.Namespace) -> Any:
    from search_spaces.strategy import PLAIN, Strategy

    base = Strategy() if args.draft else PLAIN
    changes = {k: v for k, v in (
        ("draft_length", args.draft_length), ("draft_precision", args.draft_precision),
        ("confidence_threshold", args.confidence_threshold),
    ) if v is not None}
    if args.draft_vocab is not None:
        changes["draft_vocab"] = args.draft_vocab or None  # 0 = the full head
    if args.tree_widths:
        changes["tree_widths"] = _int_list("--tree-widths", args.tree_widths)
        changes.setdefault("draft_length", len(changes["tree_widths"]))
    if args.dynamic_widths:
        changes["dynamic_widths"] = _width_table(args.dynamic_widths)
    return Strategy.from_dict({**base.to_dict(), **changes})


def _int_list(flag: str, text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise CliError(f"{flag} takes comma-separated integers like 4,2,2,1,1, got {text!r}") from None


def _width_table(text: str) -> list[list[float | int]]:
    from search_spaces.strategy import SWIFT_DYNAMIC_WIDTHS

    if text == "swift":
        return [list(row) for row in SWIFT_DYNAMIC_WIDTHS]
    try:
        return [[float(p), int(k)] for p, k in (row.split(":") for row in text.split(","))]
    except ValueError:
        raise CliError(f"--dynamic-widths takes 'swift' or P:K pairs like 0.5:10,0.8:5,0.95:3,1:1, got {text!r}") from None


def _prompt_items(args: argparse.Namespace) -> list[Any]:
    """The prompts to run (read before any model loads, so bad task input fails fast)."""
    from studies import Prompt, load_prompts

    if getattr(args, "prompt", None) is not None:
        if args.task:
            raise CliError("give either --prompt or --task, not both")
        return [Prompt(id="prompt", messages=(("user", args.prompt),), text=args.prompt)]
    if args.task:
        return load_prompts(args.task, args.data, args.limit, args.offset)
    raise CliError("nothing to generate: pass --prompt TEXT or --task NAME")


def _tokenize(items: list[Any], tokenizer: Any) -> list[tuple[str, list[int]]]:
    from studies import encode_prompt

    return [(item.id, encode_prompt(item, tokenizer)) for item in items]


def _generation_config(args: argparse.Namespace, eos: tuple[int, ...]) -> Any:
    from runtime.decoding import GenerationConfig
    from runtime.sampling import SamplingParams

    try:
        sampling = SamplingParams(
            temperature=getattr(args, "temperature", 0.0), top_k=getattr(args, "top_k", 0),
            top_p=getattr(args, "top_p", 1.0),
        )
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    return GenerationConfig(
        max_new_tokens=args.max_new_tokens, sampling=sampling, seed=getattr(args, "seed", 0), eos_token_ids=eos
    )


def _fitting_prompts(args: argparse.Namespace, pool: Any, target: Any, items: list[Any]) -> tuple[list[Any], Any]:
    """Tokenised prompts and the generation config; a prompt too long for the context fails here."""
    from runtime.pipeline import eos_ids

    prompts = _tokenize(items, target.tokenizer)
    cfg = _generation_config(args, eos_ids(target))
    _check_prompts_fit(pool, target, prompts, cfg)
    return prompts, cfg


def _check_prompts_fit(pool: Any, target: Any, prompts: list[tuple[str, list[int]]], cfg: Any) -> None:
    from runtime.pipeline import build_decoder
    from search_spaces.strategy import PLAIN

    checker = build_decoder(pool, target, PLAIN, None)
    for _, ids in prompts:
        checker.check_fits(len(ids), cfg)


def _synthetic_prompts(args: argparse.Namespace, pool: Any, target: Any) -> tuple[list[Any], Any]:
    """``--limit`` seeded random prompts of ``--prompt-len`` ids for random-weight models, decoded
    without EOS (every method runs the full budget: only the costs mean anything)."""
    import torch

    cfg = _generation_config(args, ())
    vocab = target.hf_model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [(f"random-{i}", torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist())
               for i in range(args.limit or 5)]
    _check_prompts_fit(pool, target, prompts, cfg)
    return prompts, cfg


def _check_common(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1:
        raise CliError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.limit is not None and args.limit < 1:
        raise CliError(f"--limit must be at least 1, got {args.limit}")


_STRATEGY_FLAGS = (
    "draft_length", "draft_precision", "draft_vocab", "confidence_threshold", "tree_widths", "dynamic_widths",
)


def _task_name(args: argparse.Namespace) -> str:
    from autotune.store.resolve import PROMPT_TASK

    return args.task or PROMPT_TASK


def _check_strategy_choice(args: argparse.Namespace) -> None:
    """--strategy replaces the flag-built strategy; a bad file or store fails before any model loads."""
    spec = getattr(args, "strategy", None)
    if spec is None:
        return
    given = [f"--{name.replace('_', '-')}" for name in _STRATEGY_FLAGS if getattr(args, name) is not None]
    if given:
        raise CliError(f"--strategy replaces the strategy flags; drop {', '.join(given)} or --strategy")
    from autotune.store.resolve import check_strategy_spec

    check_strategy_spec(spec, args.storage, args.model, args.draft, _task_name(args), args.device)


def _chosen_strategy(args: argparse.Namespace, target: Any, built: Any) -> Any:
    spec = getattr(args, "strategy", None)
    if spec is None:
        return built
    from autotune.store.resolve import resolve_strategy, strategy_key

    key = strategy_key(target, args.draft, _task_name(args), args.device)
    return resolve_strategy(spec, args.storage, key, built)


def _load(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    from runtime.pipeline import ModelPool, draft_load_dtype

    strategy = _strategy(args)
    if args.draft:  # a draft precision the device cannot run fails before any load
        draft_load_dtype(strategy, args.device, args.compile)
    pool = ModelPool(device=args.device, compile=args.compile, random_weights=getattr(args, "random_weights", False))
    target = pool.get(args.model, args.dtype)
    strategy = _chosen_strategy(args, target, strategy)
    if args.draft:
        from runtime.loading import check_vocab_compatible

        check_vocab_compatible(target, pool.get(args.draft, draft_load_dtype(strategy, args.device, args.compile)))
    return pool, target, strategy


def cmd_generate(args: argparse.Namespace) -> int:
    from runtime.pipeline import build_decoder, eos_ids

    _check_common(args)
    _generation_config(args, ())  # validate sampling flags before loading anything
    items = _prompt_items(args)
    _check_strategy_choice(args)
    pool, target, strategy = _load(args)
    prompts = _tokenize(items, target.tokenizer)
    cfg = _generation_config(args, eos_ids(target))
    decoder = build_decoder(pool, target, strategy, args.draft)
    for pid, ids in prompts:
        decoder.check_fits(len(ids), cfg)
    for pid, ids in prompts:
        result = decoder.generate(ids, cfg)
        text = target.tokenizer.decode(result.tokens, skip_special_tokens=True)
        if args.json:
            print(json.dumps({"id": pid, "text": text, "tokens": result.tokens, "stats": result.stats.as_dict()}))
        else:
            s = result.stats
            print(text)
            print(f"[{pid}] {s.new_tokens} tokens, {s.tokens_per_s:.2f} tok/s, alpha {s.acceptance_rate:.2f}, "
                  f"M {s.mean_accepted:.2f}", file=sys.stderr)
    return 0


def _check_tuned_stored(args: argparse.Namespace, methods: list[Any]) -> None:
    """Method ``tuned`` needs a stored strategy: a missing one fails before any model loads."""
    from autotune.store.resolve import BEST, check_strategy_spec

    for spec in methods:
        if spec.name == "tuned":
            options = dict(spec.options)
            db = options.get("db")
            storage = f"sqlite:///{Path(db).resolve()}" if db else args.storage
            check_strategy_spec(BEST, storage, args.model, args.draft, options.get("task", args.task), args.device)


def cmd_bench(args: argparse.Namespace) -> int:
    from autotune.measure.bench import SHARED_WIDTH, BenchContext, format_table, parse_methods, run_bench, write_report

    _check_common(args)
    methods = parse_methods(args.methods)
    if args.random_weights:
        if args.task:
            raise CliError("--random-weights runs synthetic prompts (random models have no tokenizer); drop --task")
        if args.prompt_len < 1:
            raise CliError(f"--prompt-len must be at least 1, got {args.prompt_len}")
        items = []
    elif not args.task:
        raise CliError("bench needs --task NAME (or --random-weights for synthetic prompts on random weights)")
    else:
        items = _prompt_items(args)
    _check_tuned_stored(args, methods)
    pool, target, strategy = _load(args)
    if args.random_weights:
        prompts, cfg = _synthetic_prompts(args, pool, target)
    else:
        prompts, cfg = _fitting_prompts(args, pool, target, items)
    ctx = BenchContext(
        pool=pool, target=target, draft_name=args.draft, dtype=args.dtype, strategy=strategy,
        lp_size=args.lp_size, skip_ratio=args.skip_ratio, task=args.task, storage=args.storage,
        verify_width=SHARED_WIDTH if args.shared_width else None,
    )
    report = run_bench(ctx, methods, [ids for _, ids in prompts], cfg)
    report["config"] = {
        "model": target.model_id, "draft": args.draft, "task": args.task, "limit": len(prompts),
        "max_new_tokens": args.max_new_tokens, "dtype": args.dtype, "strategy": strategy.to_dict(),
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


def cmd_diagnose(args: argparse.Namespace) -> int:
    from autotune.measure.diagnose import diagnose, format_table
    from runtime.pipeline import ModelPool
    from runtime.transformer import CausalLM

    lp_sizes = _int_list("--lp-size", args.lp_size)
    bad = [lp for lp in lp_sizes if lp < 2]
    if bad:
        raise CliError(f"--lp-size values must be at least 2 (layer-parallel groups), got {bad[0]}")
    if args.limit < 1:
        raise CliError(f"--limit must be at least 1, got {args.limit}")
    items = _prompt_items(args)
    model = ModelPool(device=args.device).get(args.model, args.dtype)
    prompts = _tokenize(items, model.tokenizer)
    report = diagnose(CausalLM(model.hf_model), [ids for _, ids in prompts], lp_sizes)
    report["config"] = {"model": model.model_id, "task": args.task, "prompt_ids": [pid for pid, _ in prompts],
                        "dtype": args.dtype}
    print(format_table(report, title=args.model))
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=2))
    return 0


def _study_defaults(args: argparse.Namespace) -> None:
    """No --model: the embedded default pair (and its draft unless --draft is given); no --task: humaneval."""
    from autotune.tuning.study import DEFAULT_DRAFT, DEFAULT_MODEL, DEFAULT_TASK

    if args.model is None:
        args.model, args.draft = DEFAULT_MODEL, args.draft or DEFAULT_DRAFT
    args.task = args.task or DEFAULT_TASK


def cmd_study(args: argparse.Namespace) -> int:
    from autotune.tuning.study import check_space_choice, default_space, run_study
    from autotune.store.storage import open_storage
    from autotune.tuning.tuner import TunerSettings
    from runtime.pipeline import ModelPool
    from search_spaces.spaces import get_space
    from studies import routing_text

    _study_defaults(args)
    _check_common(args)
    space = get_space(args.space or default_space(args.draft))  # unknown space fails before any load
    check_space_choice(space, args.draft)
    if not 0.0 <= args.skip_ratio < 1.0:
        raise CliError(f"--skip-ratio must be in [0, 1), got {args.skip_ratio}")
    given = {"window": args.window, "beta": args.beta, "max_trials": args.trials, "patience": args.patience,
             "seed": args.seed, "match_threshold": args.stop_matchness, "max_share": args.max_share}
    settings = TunerSettings(**{k: v for k, v in given.items() if v is not None})  # the rest: TunerSettings' defaults
    items = _prompt_items(args)
    with open_storage(args.storage) as storage:  # an unreachable store fails before any load
        pool = ModelPool(device=args.device)
        target = pool.get(args.model, args.dtype)
        if args.draft:
            from runtime.loading import check_vocab_compatible

            check_vocab_compatible(target, pool.get(args.draft, "float32"))
        prompts, cfg = _fitting_prompts(args, pool, target, items)
        report = run_study(
            pool, target, args.draft, args.task, [ids for _, ids in prompts], cfg, storage, space.name, settings,
            skip_ratio=args.skip_ratio, prompt_texts=[routing_text(item) for item in items], baseline=args.baseline,
        )
    print(format_study(report))
    if report.refused:  # one line on stderr: the lossless check failed and nothing lossy was kept
        print(f"autotune: refused to store the tuned strategy: its output differed from plain decoding on "
              f"the check prompts; kept plain decoding for {args.model} / {args.task}", file=sys.stderr)
    if args.json_out:
        from autotune.measure.bench import write_report

        write_report(report.as_dict(), args.json_out)
    if args.plot:
        from autotune.cli.report import plot_study

        print(f"plots: {plot_study(args.storage, report.name, args.plot)}")
    return 1 if report.refused else 0


def format_study(report: Any) -> str:
    from rich.console import Console
    from rich.table import Table

    t = report.tuner
    table = Table(title=f"study {report.name}", show_header=False)
    table.add_column("field")
    table.add_column("value", overflow="fold")
    plain_pred = t.get("plain_predicted_tps")
    stored = report.stored_reason
    rows = [
        ("best strategy", report.best.to_json()),
        ("uniform (start)", report.uniform.to_json()),
        ("trials", f"{t['trials']} ({t['stop_reason']})"),
        ("best matchness", f"{t['best_matchness']:.3f}"),
        ("predicted tok/s", f"{t['best_predicted_tps']:.2f}" + (f" (plain {plain_pred:.2f})" if plain_pred else "")),
        ("measured tok/s", f"{report.best_tps:.2f} (plain {report.plain_tps:.2f}, same prompts, same run)"),
        ("speedup vs plain", f"{report.speedup:.2f}x, outputs {'identical' if report.identical else 'DIFFERENT'}"),
        ("predicted / measured", _ratio_text(t.get("stored") or {})),
        ("tuning share", f"{100 * report.tuning_share:.1f}% of decode time while tuning "
                         f"({t['trials']} trials, {t.get('measured_trials', 0)} measured; "
                         f"{t.get('swept', 0)} grid points swept on {t.get('windows', 0)} windows)"),
        ("while tuning", _while_tuning_text(report)),
        ("stored", f"{stored} in {report.storage_url} (history row {report.history_id})"),
    ]
    for k, v in rows:
        table.add_row(k, v)
    console = Console(width=120, record=True)
    with console.capture() as cap:
        console.print(table)
    return cap.get()


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
    """The stored strategy's corrected prediction against its decode-round speed on the check prompts."""
    if not stored.get("ratio"):
        return "-"
    return (f"{stored['ratio']:.2f} (predicted {stored['predicted_tps']:.2f} tok/s, decode rounds measured "
            f"{stored['decode_tps']:.2f} on the check prompts)")


def cmd_serve(args: argparse.Namespace) -> int:
    from autotune.serving.server import ServeConfig, serve

    adaptive = AdaptDefaults(
        acceptance_drop=args.acceptance_drop, retune_requests=args.retune_requests, retune_share=args.retune_share,
        new_route_requests=args.new_route_requests, recheck_plain_requests=args.recheck_plain_requests,
    ) if args.adaptive else None
    return serve(ServeConfig(
        model=args.model, draft=args.draft, dtype=args.dtype, device=args.device, compile=args.compile,
        storage=args.storage, host=args.host, port=args.port, max_queue=args.max_queue, route_distance=args.route_distance,
        adaptive=adaptive,
    ))


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "generate": cmd_generate,
    "bench": cmd_bench,
    "study": cmd_study,
    "diagnose": cmd_diagnose,
    "strategies": cmd_strategies,
    "serve": cmd_serve,
    "profile": cmd_profile,
    "report": cmd_report,
    "replay": cmd_replay,
}


def _quiet_libraries() -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _quiet_libraries()
        return COMMANDS[args.command](args)
    except USER_ERRORS as exc:
        print(f"autotune: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("autotune: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
