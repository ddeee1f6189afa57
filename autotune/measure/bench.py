"""``autotune bench``: run decoding methods on the same prompts in one process, interleaved."""
from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from runtime.compiled import NEW_STEPS, bucketed
from runtime.decoding import GenerationConfig
from runtime.loading import LoadedModel
from runtime.pipeline import ModelPool, build_decoder, default_draft, draft_load_precision
from runtime.stats import DecodeStats
from search_spaces.layer_plan import SKIP_RATIO, easyspec_plan, uniform_skip_plan
from search_spaces.strategy import DEFAULT_TREE_WIDTHS, PLAIN, Strategy

from autotune.errors import MethodError
from autotune.measure import peers


@dataclass
class BenchContext:
    pool: ModelPool
    target: LoadedModel
    draft_name: str | None
    dtype: str
    strategy: Strategy
    lp_size: int = 4  # EasySpec layer-parallel size for method `easyspec`
    skip_ratio: float = SKIP_RATIO  # SWIFT uniform skip ratio for method `selfspec`
    options: dict[str, str] = field(default_factory=dict)  # per-method overrides (`easyspec:lp2:nocal`)
    task: str = "prompts"  # the bench's task: method `tuned` loads the strategy stored for it
    storage: str | None = None  # strategy store URL for method `tuned` (None: the default store)
    verify_width: int | None = None  # pad every speculative method's verify pass to this width


@dataclass
class MethodRun:
    tokens: list[int]
    stats: DecodeStats
    info: dict[str, Any] = field(default_factory=dict)  # a peer's notes per prompt (e.g. llama.cpp's prompt check)


Method = Callable[[list[int], GenerationConfig], MethodRun]
MethodFactory = Callable[[BenchContext], Method]


def _hf(ctx: BenchContext, assistant: LoadedModel | None = None, static: bool = False) -> Method:
    model = _float_tree(ctx, ctx.target)

    def run(prompt: list[int], cfg: GenerationConfig) -> MethodRun:
        ids = torch.tensor([prompt], device=model.device)
        kwargs: dict[str, Any] = dict(
            max_new_tokens=cfg.max_new_tokens, do_sample=False, attention_mask=torch.ones_like(ids),
            pad_token_id=cfg.eos_token_ids[0] if cfg.eos_token_ids else None,
        )
        if assistant is not None:
            kwargs["assistant_model"] = _float_tree(ctx, assistant)
        if static:
            cache_len = static_cache_len(len(prompt), cfg.max_new_tokens)
            kwargs.update(cache_implementation="static", max_cache_len=cache_len)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, **kwargs)
        wall = time.perf_counter() - start
        tokens = out[0, len(prompt):].tolist()
        stats = DecodeStats(new_tokens=len(tokens), wall_s=wall)
        return MethodRun(tokens, stats)

    return run


STATIC_CACHE_BUCKET = 512  # hf-static sizes its cache in these steps: one compiled graph per bucket, not per prompt


def static_cache_len(prompt_len: int, max_new_tokens: int) -> int:
    """The static cache length for a prompt: its worst case rounded up to a bucket."""
    return bucketed(prompt_len + max_new_tokens, STATIC_CACHE_BUCKET)


def _float_tree(ctx: BenchContext, model: LoadedModel) -> Any:
    """The HF module tree HF's ``generate`` runs: ``model``'s, or a float32 one where it holds only
    GGUF blocks (``runtime.gguf_model``)."""
    return ctx.pool.get(model.name, "float32").hf_model if getattr(model.hf_model, "blocks_only", False) \
        else model.hf_model


def _hf_static(ctx: BenchContext) -> Method:
    """HF ``generate(cache_implementation="static")``, greedy: what a GPU user would pick. transformers
    compiles the decode step itself (``torch.compile``, mode ``reduce-overhead``: CUDA graphs) on
    CUDA/XPU; on CPU it runs the static cache eagerly (it does not auto-compile there), and so do we."""
    return _hf(ctx, static=True)


def _hf_assisted(ctx: BenchContext) -> Method:
    if ctx.draft_name is None:
        raise MethodError("method 'hf-assisted' needs a draft model; pass --draft MODEL")
    return _hf(ctx, ctx.pool.get(ctx.draft_name, ctx.dtype))


def _ours(strategy_of: Callable[[BenchContext], Strategy]) -> MethodFactory:
    def factory(ctx: BenchContext) -> Method:
        strategy = strategy_of(ctx)
        draft = ctx.draft_name if strategy.drafter == "draft-model" else None
        width = ctx.verify_width if strategy.speculates else None
        decoder = build_decoder(ctx.pool, ctx.target, strategy, draft, verify_width=width)

        def run(prompt: list[int], cfg: GenerationConfig) -> MethodRun:
            result = decoder.generate(prompt, cfg)
            return MethodRun(result.tokens, result.stats)

        return run

    return factory


def _shaped(ctx: BenchContext, s: Strategy) -> Strategy:
    """Method options ``kN`` (draft length), ``tW-W-...`` (tree widths, one per depth) and
    ``lookup`` (prompt lookup first, the draft model elsewhere) applied."""
    if ctx.options.get("lookup") == "on":
        s = replace(s, lookup_first=True)
    if "t" in ctx.options:
        widths = tuple(int(w) for w in ctx.options["t"].split("-"))
        return replace(s, draft_length=len(widths), tree_widths=widths, dynamic_widths=None)
    if "k" in ctx.options:
        k = int(ctx.options["k"])
        return replace(s, draft_length=k, tree_widths=None if s.tree_widths is None else (s.tree_widths + (1,) * k)[:k])
    return s


def _sd_strategy(ctx: BenchContext) -> Strategy:
    """The strategy from the command line (a chain unless --tree-widths/--dynamic-widths)."""
    if ctx.draft_name is None:
        raise MethodError("method 'sd' needs a draft model; pass --draft MODEL")
    return _shaped(ctx, ctx.strategy)


def _tree_strategy(ctx: BenchContext) -> Strategy:
    """The command line's tree, else the default tree shape."""
    if ctx.draft_name is None:
        raise MethodError("method 'sd-tree' needs a draft model; pass --draft MODEL")
    s = ctx.strategy
    if s.tree_widths is not None or s.dynamic_widths is not None:
        return _shaped(ctx, s)
    return _shaped(ctx, replace(s, draft_length=len(DEFAULT_TREE_WIDTHS), tree_widths=DEFAULT_TREE_WIDTHS))


def _lookup_strategy(ctx: BenchContext) -> Strategy:
    return Strategy(drafter="prompt-lookup", draft_length=int(ctx.options.get("k", ctx.strategy.draft_length)))


def _easyspec_strategy(ctx: BenchContext) -> Strategy:
    """The command line's draft strategy with EasySpec's default layer-parallel plan (table 6)."""
    if ctx.draft_name is None:
        raise MethodError("method 'easyspec' needs a draft model; pass --draft MODEL")
    lp = int(ctx.options.get("lp", ctx.lp_size))
    n_layers = ctx.pool.get(ctx.draft_name, draft_load_precision(ctx.strategy, ctx.pool.device, ctx.pool.compile)).hf_model.config.num_hidden_layers
    calibrate = ctx.options.get("cal", "on" if ctx.strategy.calibrate else "off") == "on"
    return replace(ctx.strategy, layer_plan=easyspec_plan(n_layers, lp), calibrate=calibrate,
                   lookup_first=ctx.options.get("lookup") == "on")


def _selfspec_strategy(ctx: BenchContext) -> Strategy:
    """SWIFT self-speculation: the target with a uniform layer skip (``--skip-ratio``)."""
    ratio = float(ctx.options.get("r", ctx.skip_ratio))
    n_layers = ctx.target.hf_model.config.num_hidden_layers
    s = ctx.strategy
    return Strategy(
        drafter="layer-skip", draft_length=s.draft_length, confidence_threshold=s.confidence_threshold,
        tree_widths=s.tree_widths, dynamic_widths=s.dynamic_widths, layer_plan=uniform_skip_plan(n_layers, ratio),
    )


def _uniform_strategy(ctx: BenchContext) -> Strategy:
    """What ``autotune study`` starts from before tuning (its default space's reference): EasySpec's
    default layer-parallel plan with a draft model, SWIFT's uniform skip (``--skip-ratio``) without."""
    from autotune.tuning.study import reference_space, space_context
    from search_spaces.spaces import get_space, uniform_strategy

    space = get_space(reference_space(ctx.draft_name))
    draft = default_draft(ctx.pool, ctx.draft_name) if ctx.draft_name else None
    ratio = float(ctx.options.get("r", ctx.skip_ratio))
    return uniform_strategy(space.name, space_context(space, ctx.target, draft, ratio))


def _tuned_strategy(ctx: BenchContext) -> Strategy:
    """The stored best for (model, draft, task, this hardware); ``tuned:task=T`` reads another task's,
    ``tuned:db=FILE`` another SQLite store's (two studies' picks side by side in one run)."""
    from autotune.store.resolve import BEST, resolve_strategy, strategy_key

    key = strategy_key(ctx.target, ctx.draft_name, ctx.options.get("task", ctx.task), ctx.pool.device)
    db = ctx.options.get("db")
    return resolve_strategy(BEST, f"sqlite:///{Path(db).resolve()}" if db else ctx.storage, key, PLAIN)


def _peer(name: str) -> MethodFactory:
    """Another engine on the same GGUF files and prompts (``autotune.measure.peers``)."""
    def factory(ctx: BenchContext) -> Method:
        peer = peers.make_peer(name, ctx.target, ctx.draft_name, ctx.options, torch.get_num_threads())

        def run(prompt: list[int], cfg: GenerationConfig) -> MethodRun:
            done = peer(prompt, cfg)
            return MethodRun(done.tokens, done.stats, done.info)

        return run

    return factory


# our runtime's methods: name -> the strategy it decodes with
STRATEGY_METHODS: dict[str, Callable[[BenchContext], Strategy]] = {
    "vanilla": lambda ctx: PLAIN,
    "sd": _sd_strategy,
    "sd-tree": _tree_strategy,
    "lookup": _lookup_strategy,
    "easyspec": _easyspec_strategy,
    "selfspec": _selfspec_strategy,
    "uniform": _uniform_strategy,
    "tuned": _tuned_strategy,
}

METHODS: dict[str, MethodFactory] = {
    "hf": _hf,
    "hf-static": _hf_static,
    "hf-assisted": _hf_assisted,
    **{name: _ours(strategy_of) for name, strategy_of in STRATEGY_METHODS.items()},
    **{name: _peer(name) for name in peers.VARIANTS},  # llama.cpp (`make peers`)
}

# method options, written `name:opt:opt` (e.g. `easyspec:lp2:nocal`, `selfspec:r0.3`): prefix -> (key, value)
METHOD_OPTIONS: dict[str, Callable[[str], tuple[str, str]]] = {
    "lp": lambda rest: ("lp", str(int(rest))),
    "r": lambda rest: ("r", str(float(rest))),
    "nocal": lambda rest: ("cal", "off"),
    "lookup": lambda rest: ("lookup", "on"),
    "cal": lambda rest: ("cal", "on"),
    "task=": lambda rest: ("task", _nonempty(rest)),
    "db=": lambda rest: ("db", _existing_file(rest)),
    "k": lambda rest: ("k", str(_positive(rest))),
    "t": lambda rest: ("t", "-".join(str(_positive(w)) for w in rest.split("-"))),
}


LOOKUP_FIRST_METHODS = ("sd", "sd-tree", "easyspec")  # methods that honour option `lookup`


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"{value} is not positive")
    return value


def _existing_file(text: str) -> str:
    if not Path(text).is_file():
        raise ValueError(f"no file {text}")
    return text


def _nonempty(text: str) -> str:
    if not text:
        raise ValueError("empty option value")
    return text


@dataclass(frozen=True)
class MethodSpec:
    label: str  # as written on the command line; the report's key
    name: str  # the METHODS entry
    options: tuple[tuple[str, str], ...] = ()


def parse_method(text: str) -> MethodSpec:
    name, *opts = text.split(":")
    if name not in METHODS:
        raise MethodError(f"unknown bench method {name!r}; choose from {', '.join(METHODS)}")
    parsed = []
    for opt in opts:
        prefix = next((p for p in sorted(METHOD_OPTIONS, key=len, reverse=True) if opt.startswith(p)), None)
        try:
            if prefix is None or (prefix in ("nocal", "cal", "lookup") and opt != prefix):
                raise ValueError
            parsed.append(METHOD_OPTIONS[prefix](opt[len(prefix):]))
        except ValueError:
            raise MethodError(
                f"bad option {opt!r} in bench method {text!r}; options: lpN (layer-parallel size), rX (skip "
                "ratio), cal / nocal (bonus calibration), task=NAME (tuned on that task), db=FILE (tuned, read from that SQLite "
                "store, which must exist), kN (draft length), tW-W-... (tree widths), lookup (prompt lookup first, the "
                "draft model elsewhere), e.g. easyspec:lp2:nocal, tuned:db=auto.db, sd:k4, sd-tree:t2-1-1-1, sd:lookup"
            ) from None
    if ("lookup", "on") in parsed and name not in LOOKUP_FIRST_METHODS:
        raise MethodError(
            f"option lookup in bench method {text!r}: only the draft-model methods ({', '.join(LOOKUP_FIRST_METHODS)}) "
            "draft with prompt lookup first, e.g. sd:lookup"
        )
    return MethodSpec(text, name, tuple(parsed))


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
        started = time.perf_counter()
        for prompt in warm_prompts:
            runner(prompt, warm)
        compile_s[name] = time.perf_counter() - started
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


HF_METHODS = ("hf", "hf-static", "hf-assisted")  # Hugging Face's float32 forward, whatever --precision says


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
