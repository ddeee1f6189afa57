"""The methods ``autotune bench`` runs, by name (``METHODS``): Hugging Face's ``generate`` (plain,
static cache, assisted), our runtime under a strategy per method (``STRATEGY_METHODS``), and the
peers on the same GGUF files (``autotune.measure.peers``); and how a method is written on the
command line (``name:opt:opt``, ``parse_method``)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from runtime.compiled import bucketed
from runtime.decoding import GenerationConfig
from runtime.loading import LoadedModel
from runtime.pipeline import ModelPool, build_decoder, default_draft, draft_load_precision
from runtime.stats import DecodeStats
from search_spaces.layer_plan import SKIP_RATIO, easyspec_plan, uniform_skip_plan
from search_spaces.strategy import DEFAULT_TREE_WIDTHS, PLAIN, Strategy

from autotune.errors import MethodError
from autotune.measure import peers
from autotune.timing import Stopwatch


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
        with Stopwatch() as generating, torch.inference_mode():
            out = model.generate(ids, **kwargs)
        tokens = out[0, len(prompt):].tolist()
        stats = DecodeStats(new_tokens=len(tokens), wall_s=generating.seconds)
        return MethodRun(tokens, stats)

    return run


STATIC_CACHE_BUCKET = 512  # hf-static sizes its cache in these steps: one compiled graph per bucket, not per prompt


def static_cache_len(prompt_len: int, max_new_tokens: int) -> int:
    """The static cache length for a prompt: its worst case rounded up to a bucket."""
    return bucketed(prompt_len + max_new_tokens, STATIC_CACHE_BUCKET)


def _float_tree(ctx: BenchContext, model: LoadedModel) -> Any:
    """The HF module tree HF's ``generate`` runs: ``model``'s, or a float32 one where it holds only
    GGUF blocks (``runtime.gguf_model``)."""
    return ctx.pool.get(model.name, "float32").hf_model if model.blocks_only else model.hf_model


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


HF_METHODS = ("hf", "hf-static", "hf-assisted")  # Hugging Face's float32 forward, whatever --precision says
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
