"""What several commands read from their flags before they run: the prompts, the generation config,
the models and the strategy. Bad input fails here, before any model loads where it can."""
from __future__ import annotations

import argparse
from typing import Any

from autotune.cli.args import STRATEGY_FLAGS, int_list, width_table
from autotune.errors import CliError


# ---------------------------------------------------------------------- prompts
def check_common(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1:
        raise CliError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.limit is not None and args.limit < 1:
        raise CliError(f"--limit must be at least 1, got {args.limit}")


def prompt_items(args: argparse.Namespace) -> list[Any]:
    """The prompts to run (read before any model loads, so bad task input fails fast)."""
    from studies import Prompt, load_prompts

    if getattr(args, "prompt", None) is not None:
        if args.task:
            raise CliError("give either --prompt or --task, not both")
        return [Prompt(id="prompt", messages=(("user", args.prompt),), text=args.prompt)]
    if args.task:
        return load_prompts(args.task, args.data, args.limit, args.offset)
    raise CliError("nothing to generate: pass --prompt TEXT or --task NAME")


def tokenize(items: list[Any], tokenizer: Any) -> list[tuple[str, list[int]]]:
    from studies import encode_prompt

    return [(item.id, encode_prompt(item, tokenizer)) for item in items]


def generation_config(args: argparse.Namespace, eos: tuple[int, ...]) -> Any:
    from runtime.decoding import GenerationConfig
    from runtime.sampling import SamplingParams

    given = {name: getattr(args, name) for name in ("temperature", "top_k", "top_p") if hasattr(args, name)}
    try:
        sampling = SamplingParams(**given)  # a command without sampling flags: the defaults (greedy)
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    seed = {"seed": args.seed} if hasattr(args, "seed") else {}
    return GenerationConfig(max_new_tokens=args.max_new_tokens, sampling=sampling, eos_token_ids=eos, **seed)


def fitting_prompts(args: argparse.Namespace, pool: Any, target: Any, items: list[Any]) -> tuple[list[Any], Any]:
    """Tokenised prompts and the generation config; a prompt too long for the context fails here."""
    from runtime.pipeline import eos_ids

    prompts = tokenize(items, target.tokenizer)
    cfg = generation_config(args, eos_ids(target))
    check_prompts_fit(pool, target, prompts, cfg)
    return prompts, cfg


def check_prompts_fit(pool: Any, target: Any, prompts: list[tuple[str, list[int]]], cfg: Any) -> None:
    from runtime.pipeline import build_decoder
    from search_spaces.strategy import PLAIN

    checker = build_decoder(pool, target, PLAIN, None)
    for _, ids in prompts:
        checker.check_fits(len(ids), cfg)


# ---------------------------------------------------------------------- strategy and models
def build_strategy(args: argparse.Namespace) -> Any:
    """The strategy the strategy flags describe (on the default strategy with --draft, else plain)."""
    from search_spaces.strategy import PLAIN, Strategy

    base = Strategy() if args.draft else PLAIN
    changes = {k: v for k, v in (
        ("draft_length", args.draft_length), ("draft_precision", args.draft_precision),
        ("confidence_threshold", args.confidence_threshold),
    ) if v is not None}
    if args.draft_vocab is not None:
        changes["draft_vocab"] = args.draft_vocab or None  # 0 = the full head
    if args.tree_widths:
        changes["tree_widths"] = int_list("--tree-widths", args.tree_widths)
        changes.setdefault("draft_length", len(changes["tree_widths"]))
    if args.dynamic_widths:
        changes["dynamic_widths"] = width_table(args.dynamic_widths)
    return Strategy.from_dict({**base.to_dict(), **changes})


def task_name(args: argparse.Namespace) -> str:
    from autotune.store.resolve import PROMPT_TASK

    return args.task or PROMPT_TASK


def check_strategy_choice(args: argparse.Namespace) -> None:
    """--strategy replaces the flag-built strategy; a bad file or store fails before any model loads."""
    spec = getattr(args, "strategy", None)
    if spec is None:
        return
    given = [f"--{name.replace('_', '-')}" for name in STRATEGY_FLAGS if getattr(args, name) is not None]
    if given:
        raise CliError(f"--strategy replaces the strategy flags; drop {', '.join(given)} or --strategy")
    from autotune.store.resolve import check_strategy_spec

    check_strategy_spec(spec, args.storage, args.model, args.draft, task_name(args), args.device)


def chosen_strategy(args: argparse.Namespace, target: Any, built: Any) -> Any:
    """``built`` (from the flags), or what ``--strategy`` names for this model, draft, task and hardware."""
    spec = getattr(args, "strategy", None)
    if spec is None:
        return built
    from autotune.store.resolve import resolve_strategy, strategy_key

    key = strategy_key(target, args.draft, task_name(args), args.device)
    return resolve_strategy(spec, args.storage, key, built)


def load_models(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """(model pool, target, strategy): the target and the draft loaded, their vocabularies checked."""
    from runtime.pipeline import ModelPool, draft_load_precision

    from runtime.precision import get_precision

    strategy = build_strategy(args)
    get_precision(args.precision, args.device, args.compile)  # a precision the device cannot run: before any load
    if args.draft:  # a draft precision the device cannot run fails before any load
        draft_load_precision(strategy, args.device, args.compile)
    pool = ModelPool(device=args.device, compile=args.compile, random_weights=getattr(args, "random_weights", False))
    target = pool.get(args.model, args.precision)
    strategy = chosen_strategy(args, target, strategy)
    if args.draft:
        from runtime.loading import check_vocab_compatible

        check_vocab_compatible(target, pool.get(args.draft, draft_load_precision(strategy, args.device, args.compile)))
    return pool, target, strategy
