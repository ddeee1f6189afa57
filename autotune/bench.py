"""``autotune bench``: run decoding methods on the same prompts in one process, interleaved."""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from runtime.decoding import GenerationConfig
from runtime.loading import LoadedModel
from runtime.pipeline import ModelPool, build_decoder, eos_ids
from runtime.stats import DecodeStats
from search_spaces.strategy import DEFAULT_TREE_WIDTHS, PLAIN, Strategy

from autotune.errors import CliError


@dataclass
class BenchContext:
    pool: ModelPool
    target: LoadedModel
    draft_name: str | None
    dtype: str
    strategy: Strategy


@dataclass
class MethodRun:
    tokens: list[int]
    stats: DecodeStats


Method = Callable[[list[int], GenerationConfig], MethodRun]
MethodFactory = Callable[[BenchContext], Method]


def _hf(ctx: BenchContext, assistant: LoadedModel | None = None) -> Method:
    model = ctx.target.hf_model

    def run(prompt: list[int], cfg: GenerationConfig) -> MethodRun:
        ids = torch.tensor([prompt], device=model.device)
        kwargs: dict[str, Any] = dict(
            max_new_tokens=cfg.max_new_tokens, do_sample=False, attention_mask=torch.ones_like(ids),
            pad_token_id=cfg.eos_token_ids[0] if cfg.eos_token_ids else None,
        )
        if assistant is not None:
            kwargs["assistant_model"] = assistant.hf_model
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, **kwargs)
        wall = time.perf_counter() - start
        tokens = out[0, len(prompt):].tolist()
        stats = DecodeStats(new_tokens=len(tokens), wall_s=wall)
        return MethodRun(tokens, stats)

    return run


def _hf_assisted(ctx: BenchContext) -> Method:
    if ctx.draft_name is None:
        raise CliError("method 'hf-assisted' needs a draft model; pass --draft MODEL")
    return _hf(ctx, ctx.pool.get(ctx.draft_name, ctx.dtype))


def _ours(strategy_of: Callable[[BenchContext], Strategy]) -> MethodFactory:
    def factory(ctx: BenchContext) -> Method:
        decoder = build_decoder(ctx.pool, ctx.target, strategy_of(ctx), ctx.draft_name)

        def run(prompt: list[int], cfg: GenerationConfig) -> MethodRun:
            result = decoder.generate(prompt, cfg)
            return MethodRun(result.tokens, result.stats)

        return run

    return factory


def _sd_strategy(ctx: BenchContext) -> Strategy:
    """The strategy from the command line (a chain unless --tree-widths/--dynamic-widths)."""
    if ctx.draft_name is None:
        raise CliError("method 'sd' needs a draft model; pass --draft MODEL")
    return ctx.strategy


def _tree_strategy(ctx: BenchContext) -> Strategy:
    """The command line's tree, else the default tree shape."""
    if ctx.draft_name is None:
        raise CliError("method 'sd-tree' needs a draft model; pass --draft MODEL")
    s = ctx.strategy
    if s.tree_widths is not None or s.dynamic_widths is not None:
        return s
    return replace(s, draft_length=len(DEFAULT_TREE_WIDTHS), tree_widths=DEFAULT_TREE_WIDTHS)


def _lookup_strategy(ctx: BenchContext) -> Strategy:
    return Strategy(drafter="prompt-lookup", draft_length=ctx.strategy.draft_length)


METHODS: dict[str, MethodFactory] = {
    "hf": _hf,
    "hf-assisted": _hf_assisted,
    "vanilla": _ours(lambda ctx: PLAIN),
    "sd": _ours(_sd_strategy),
    "sd-tree": _ours(_tree_strategy),
    "lookup": _ours(_lookup_strategy),
}


@dataclass
class MethodTotals:
    stats: DecodeStats = field(default_factory=DecodeStats)
    outputs: list[list[int]] = field(default_factory=list)


def parse_methods(text: str) -> list[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in names if m not in METHODS]
    if not names or unknown:
        raise CliError(f"unknown bench method(s) {unknown or text!r}; choose from {', '.join(METHODS)}")
    if len(set(names)) != len(names):
        raise CliError(f"bench method listed twice in {text!r}")
    return names


def run_bench(
    ctx: BenchContext, methods: list[str], prompts: list[list[int]], cfg: GenerationConfig, warmup_tokens: int = 8
) -> dict[str, Any]:
    """Warm every method up, then run prompt by prompt, methods interleaved; summarise."""
    runners = {name: METHODS[name](ctx) for name in methods}
    warm = GenerationConfig(max_new_tokens=min(warmup_tokens, cfg.max_new_tokens), eos_token_ids=cfg.eos_token_ids)
    for runner in runners.values():
        runner(prompts[0], warm)
    totals = {name: MethodTotals() for name in methods}
    with tqdm(total=len(prompts) * len(methods), desc="bench", unit="run") as bar:
        for prompt in prompts:
            for name, runner in runners.items():
                bar.set_postfix_str(name)
                run = runner(prompt, cfg)
                totals[name].stats = totals[name].stats.merge(run.stats)
                totals[name].outputs.append(run.tokens)
                bar.update(1)
    return summarise(totals, methods)


def summarise(totals: dict[str, MethodTotals], methods: list[str]) -> dict[str, Any]:
    baseline = "hf" if "hf" in totals else ("vanilla" if "vanilla" in totals else methods[0])
    base = totals[baseline]
    report: dict[str, Any] = {"baseline": baseline, "methods": {}}
    speculative = {"sd", "sd-tree", "lookup", "hf-assisted"}
    for name in methods:
        s = totals[name].stats
        drafted = s.drafted > 0 or name in speculative
        report["methods"][name] = {
            "tokens_per_s": s.tokens_per_s,
            "new_tokens": s.new_tokens,
            "wall_s": s.wall_s,
            "acceptance_rate": s.acceptance_rate if s.drafted else None,
            "mean_accepted": s.mean_accepted if s.target_forwards else None,
            "draft_ms_per_100": s.draft_ms_per_100 if s.target_forwards and drafted else None,
            "verify_ms_per_100": s.verify_ms_per_100 if s.target_forwards else None,
            "speedup_vs_baseline": s.tokens_per_s / base.stats.tokens_per_s if base.stats.tokens_per_s else None,
            "identical_to_baseline": totals[name].outputs == base.outputs,
            "mean_tree_size": s.mean_tree_size if s.draft_rounds else None,
            "accept_hist": s.accept_hist if s.drafted else None,
        }
    return report


def write_report(report: dict[str, Any], path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=2))
    tmp.replace(path)


def format_table(report: dict[str, Any]) -> str:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"bench (baseline: {report['baseline']})")
    cols = ["method", "tok/s", "speedup", "identical", "alpha", "M", "tree", "draft ms/100", "verify ms/100", "tokens"]
    for c in cols:
        table.add_column(c, justify="right" if c != "method" else "left")
    for name, m in report["methods"].items():
        table.add_row(
            name, f"{m['tokens_per_s']:.2f}", _fmt(m["speedup_vs_baseline"], "{:.2f}x"),
            "yes" if m["identical_to_baseline"] else "NO", _fmt(m["acceptance_rate"], "{:.3f}"),
            _fmt(m["mean_accepted"], "{:.2f}"), _fmt(m["mean_tree_size"], "{:.1f}"),
            _fmt(m["draft_ms_per_100"], "{:.0f}"),
            _fmt(m["verify_ms_per_100"], "{:.0f}"), str(m["new_tokens"]),
        )
    console = Console(width=120, record=True)
    with console.capture() as cap:
        console.print(table)
    return cap.get()


def _fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)
