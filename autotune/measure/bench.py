"""``autotune bench``: run decoding methods on the same prompts in one process, interleaved."""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from runtime.compiled import NEW_STEPS, bucketed
from runtime.decoding import GenerationConfig
from runtime.stats import DecodeStats

from autotune.errors import MethodError
from autotune.measure import peers
from autotune.measure.methods import (
    HF_METHODS, METHODS, STRATEGY_METHODS, BenchContext, MethodSpec, parse_method,
)
from autotune.timing import Stopwatch


@dataclass
class MethodTotals:
    stats: DecodeStats = field(default_factory=DecodeStats)
    outputs: list[list[int]] = field(default_factory=list)
    infos: list[dict[str, Any]] = field(default_factory=list)


def parse_methods(text: str) -> list[MethodSpec]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    if not names:
        raise MethodError(f"no bench method in {text!r}; choose from {', '.join(METHODS)}")
    if len(set(names)) != len(names):
        raise MethodError(f"bench method listed twice in {text!r}")
    return [parse_method(n) for n in names]


def run_bench(
    ctx: BenchContext, specs: list[MethodSpec], prompts: list[list[int]], cfg: GenerationConfig, warmup_tokens: int = 8
) -> dict[str, Any]:
    """Warm every method up, then run prompt by prompt, methods interleaved; summarise."""
    if ctx.verify_width == SHARED_WIDTH:
        ctx = replace(ctx, verify_width=shared_verify_width(ctx, specs))
    runners = {spec.label: METHODS[spec.name](replace(ctx, options=dict(spec.options))) for spec in specs}
    methods = [spec.label for spec in specs]
    warm = GenerationConfig(max_new_tokens=min(warmup_tokens, cfg.max_new_tokens), eos_token_ids=cfg.eos_token_ids)
    warm_prompts = [prompts[0]]
    if ctx.pool.compile:  # compile every shape a method needs here: a whole decode per cache size bucket
        widths = (1, ctx.verify_width or shared_verify_width(ctx, specs) or 1)
        warm_prompts, warm = compile_prompts(prompts, cfg.max_new_tokens, widths), cfg
    compile_s = {}
    for name, runner in runners.items():
        with Stopwatch() as compiling:
            for prompt in warm_prompts:
                runner(prompt, warm)
        compile_s[name] = compiling.seconds
    compiled_during = dict.fromkeys(methods, 0)
    totals = {name: MethodTotals() for name in methods}
    with tqdm(total=len(prompts) * len(methods), desc="bench", unit="run") as bar:
        for prompt in prompts:
            for name, runner in runners.items():
                bar.set_postfix_str(name)
                seen = NEW_STEPS[0]
                run = runner(prompt, cfg)
                compiled_during[name] += NEW_STEPS[0] - seen
                totals[name].stats = totals[name].stats.merge(run.stats)
                totals[name].outputs.append(run.tokens)
                totals[name].infos.append(run.info)
                bar.update(1)
    report = summarise(totals, methods)
    report["precision"] = ctx.target.precision
    _identity_at_precision(report, specs, totals)
    _add_peer_notes(report, ctx, specs, totals, cfg.eos_token_ids)
    for spec in specs:  # what each of our methods decoded with (for `tuned`: what was stored)
        if spec.name in STRATEGY_METHODS:
            strategy = STRATEGY_METHODS[spec.name](replace(ctx, options=dict(spec.options)))
            report["methods"][spec.label]["strategy"] = strategy.to_dict()
    report["verify_width"] = ctx.verify_width
    if ctx.pool.compile:  # the warm-up compiled; measured runs should compile nothing
        for name in methods:
            report["methods"][name]["compile_s"] = compile_s[name]
            report["methods"][name]["compiled_in_measured_runs"] = compiled_during[name]
    return report




def _identity_at_precision(report: dict[str, Any], specs: list[MethodSpec], totals: dict[str, MethodTotals]) -> None:
    """Below float32 our methods are lossless relative to our plain decoding at the same precision:
    their identity is checked against ``vanilla``; HF rows run float32 arithmetic, so they are
    compared by agreement (``agreement_reference``), never called identical or not."""
    if report["precision"] == "float32" or "vanilla" not in totals:
        return
    ref = totals["vanilla"].outputs
    report["identity_reference"] = "vanilla"
    for spec in specs:
        same = None if spec.name in HF_METHODS else totals[spec.label].outputs == ref
        report["methods"][spec.label]["identical_to_baseline"] = same
    if any(spec.name in HF_METHODS for spec in specs):
        report["agreement_reference"] = "vanilla"
        for name, method in report["methods"].items():
            method["agreement"] = peers.agreement_rate(list(zip(ref, totals[name].outputs)))


def _add_peer_notes(
    report: dict[str, Any], ctx: BenchContext, specs: list[MethodSpec], totals: dict[str, MethodTotals],
    eos: tuple[int, ...],
) -> None:
    """With a peer in the run: every method's agreement with `vanilla` (else the baseline), the peers' notes."""
    peer_specs = [spec for spec in specs if spec.name in peers.VARIANTS]
    if not peer_specs:
        return
    reference = "vanilla" if "vanilla" in totals else report["baseline"]
    canon = peers.canonical(ctx.target.tokenizer, eos)
    ref = [canon(ids) for ids in totals[reference].outputs]
    report["agreement_reference"] = reference
    for name, method in report["methods"].items():
        method["agreement"] = peers.agreement_rate(list(zip(ref, map(canon, totals[name].outputs))))
    for spec in peer_specs:
        note = peers.describe(spec.name, ctx.target.name, ctx.draft_name)
        note["prompt_ids_match"] = all(info.get("prompt_ids_match", False) for info in totals[spec.label].infos)
        report["methods"][spec.label].update(peer=note, identical_to_baseline=None)


def compile_prompts(prompts: list[list[int]], max_new_tokens: int, widths: Sequence[int]) -> list[list[int]]:
    """One prompt per cache-size bucket that a compiled decode of these prompts meets: a decoder's
    cache holds the prompt, the token budget and its verify width (1 for plain decoding), and each
    bucket is a graph set of its own (``runtime.compiled.bucketed``)."""
    chosen: dict[tuple[int, ...], None] = {}
    for w in widths:  # every bucket of every width, each prompt warmed once
        buckets = {bucketed(len(p) + max_new_tokens + w + 2): p for p in reversed(prompts)}
        chosen.update(dict.fromkeys(tuple(p) for p in buckets.values()))
    return [list(p) for p in chosen]


SHARED_WIDTH = -1  # BenchContext.verify_width: the widest speculative method's width for all of them


def shared_verify_width(ctx: BenchContext, specs: list[MethodSpec]) -> int | None:
    """One verify width for all our speculative methods: one packed copy of the target in memory
    (a 1.5B fp32 target needs ~6 GiB per width), at the price of padding narrower methods."""
    widths = [
        s.max_tree_nodes + 1
        for spec in specs if spec.name in STRATEGY_METHODS
        for s in [STRATEGY_METHODS[spec.name](replace(ctx, options=dict(spec.options)))] if s.speculates
    ]
    return max(widths, default=None)


def summarise(totals: dict[str, MethodTotals], methods: list[str]) -> dict[str, Any]:
    baseline = "hf" if "hf" in totals else ("vanilla" if "vanilla" in totals else methods[0])
    base = totals[baseline]
    report: dict[str, Any] = {"baseline": baseline, "methods": {}}
    speculative = {"sd", "sd-tree", "lookup", "hf-assisted", "easyspec", "selfspec", "uniform", "tuned"}
    for name in methods:
        s = totals[name].stats
        drafted = s.drafted > 0 or name.split(":")[0] in speculative
        report["methods"][name] = {
            "tokens_per_s": s.tokens_per_s,
            "new_tokens": s.new_tokens,
            "wall_s": s.wall_s,
            "prefill_s": s.prefill_s or None,  # the prompts' processing, summed; None: not timed apart (HF)
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

    agree = "agreement_reference" in report  # a peer or HF ran: texts compared by agreement, not identity
    precision = report.get("precision", "float32")
    identity = report.get("identity_reference", report["baseline"])
    table = Table(title=f"bench at {precision} (speed baseline: {report['baseline']}; identical: to {identity})")
    cols = ["method", "tok/s", "speedup", "identical", *(["agree"] if agree else []), "alpha", "M", "tree",
            "draft ms/100", "verify ms/100", "tokens"]
    for c in cols:
        table.add_column(c, justify="right" if c != "method" else "left")
    for name, m in report["methods"].items():
        table.add_row(
            name, f"{m['tokens_per_s']:.2f}", _fmt(m["speedup_vs_baseline"], "{:.2f}x"),
            _identical(m["identical_to_baseline"]), *([f"{m['agreement']:.3f}"] if agree else []),
            _fmt(m["acceptance_rate"], "{:.3f}"), _fmt(m["mean_accepted"], "{:.2f}"),
            _fmt(m["mean_tree_size"], "{:.1f}"), _fmt(m["draft_ms_per_100"], "{:.0f}"),
            _fmt(m["verify_ms_per_100"], "{:.0f}"), str(m["new_tokens"]),
        )
    console = Console(width=120, record=True)
    with console.capture() as cap:
        console.print(table)
    notes = [peers.format_note(name, m["peer"]) for name, m in report["methods"].items() if "peer" in m]
    compiled = {name: m for name, m in report["methods"].items() if "compile_s" in m}
    if compiled:  # --compile: what the warm-up spent compiling, apart from the measured runs
        notes.append("compile (warm-up, not measured): " + ", ".join(
            f"{name} {m['compile_s']:.1f} s" + (f" ({m['compiled_in_measured_runs']} more graphs inside measured runs)"
                                                if m["compiled_in_measured_runs"] else "")
            for name, m in compiled.items()))
    if agree:
        notes.append(f"agree: share of tokens equal up to the first difference, against {report['agreement_reference']}")
    return cap.get() + "".join(f"{line}\n" for line in notes)


def _identical(same: bool | None) -> str:
    return "-" if same is None else ("yes" if same else "NO")


def _fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)
