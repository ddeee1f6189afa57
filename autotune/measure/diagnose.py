"""How well fuzzy (layer-parallel) attention approximates the exact model: EasySpec table 5.

EasySpec (section 4.3, table 5) reports the mean cosine similarity between the exact and the
fuzzy-approximated states of the attention sub-layers: the input hidden state ``h``, the queries,
keys and values, and the attention output, for layer-parallel sizes 2, 3 and 4.

Setup here: every prompt is run in one prefill forward (teacher forcing on the prompt tokens)
exactly, and again under ``easyspec_plan(n_layers, N)`` in two ways:

- fuzzy throughout (the main table): the fuzzy run's K/V for earlier positions are fuzzy too;
- exact prefix K/V: every token runs fuzzily over the exact run's K/V of the tokens before it
  (one forward with a mask, see :func:`_run`), as a draft token does after EasySpec's bonus
  calibration; errors then come from the current token's forward only.

In both, errors of earlier groups carry into later groups within a forward. For each attention
sub-layer we compare, token by token, what it actually reads and produces in the two runs: ``h`` is the exact ``h_i`` versus the fuzzy run's group input
``h_1``; ``q``/``k``/``v`` are the projections after RoPE (RoPE is a rotation per position, so it
does not change a cosine); ``attn`` is the output after ``o_proj``. Cosines are taken per token over
the whole flattened vector (all heads), averaged over tokens (all prompts pooled), then over layers:

- ``fuzzy``: the group members other than the group's first layer (where algorithm 2 changes the
  input), the quantity table 5 is about;
- ``all``: every layer (those outside groups differ only through earlier groups' errors).

``top1`` is the fraction of positions whose next-token argmax agrees between the two runs.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from runtime.errors import RuntimeUserError
from runtime.kv_cache import KVCache
from runtime.layout import Layout
from runtime.transformer import CausalLM
from search_spaces.layer_plan import LayerPlan, easyspec_plan

STATES = ("h", "q", "k", "v", "attn")
STATE_TITLES = {"h": "h", "q": "q", "k": "k", "v": "v", "attn": "Attn output"}

# EasySpec table 5: Llama-3-8B-Instruct on MMLU
PAPER_MODEL = "Llama-3-8B-Instruct, MMLU"
PAPER_TABLE5: dict[int, dict[str, float]] = {
    2: dict(zip(STATES, (0.93, 0.98, 0.99, 0.92, 0.93))),
    3: dict(zip(STATES, (0.89, 0.97, 0.98, 0.86, 0.88))),
    4: dict(zip(STATES, (0.86, 0.96, 0.97, 0.82, 0.83))),
}

SETUP = (
    "one prefill per prompt (teacher-forced), exact vs. every layer under easyspec_plan(n_layers, N); "
    "per-token cosine over all heads, mean over tokens (prompts pooled), then over layers"
)


def _flat(x: torch.Tensor) -> torch.Tensor:
    """``[heads, T, D]`` -> ``[T, heads * D]``."""
    return x.detach().transpose(0, 1).reshape(x.shape[1], -1)


def token_cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of each row of ``a`` and ``b`` ``[T, D]`` -> ``[T]`` float64 in [-1, 1].

    Identical rows give exactly 1.0; a zero row against a zero row counts as 1.0, against a
    non-zero row as 0.0."""
    a, b = a.double(), b.double()
    dot = (a * b).sum(-1)
    den = torch.sqrt((a * a).sum(-1) * (b * b).sum(-1))
    both_zero = (a == 0).all(-1) & (b == 0).all(-1)
    cos = torch.where(den > 0, dot / den.clamp_min(torch.finfo(torch.float64).tiny), torch.zeros_like(dot))
    return torch.where(both_zero, torch.ones_like(cos), cos).clamp(-1.0, 1.0)


class StateRecorder:
    """A :class:`runtime.layer_exec.Recorder` keeping every attention sub-layer's states of one
    forward (``states[layer][name]`` ``[T, D]``); with ``reference`` (an exact run's states) it
    instead accumulates per-layer cosine sums against it (``sums[layer][name]``, ``tokens``)."""

    def __init__(self, reference: dict[int, dict[str, torch.Tensor]] | None = None) -> None:
        self.reference = reference
        self.states: dict[int, dict[str, torch.Tensor]] = {}
        self.sums: dict[int, dict[str, float]] = {}
        self.tokens: dict[int, dict[str, int]] = {}

    def _put(self, li: int, name: str, x: torch.Tensor) -> None:
        if self.reference is None:
            self.states.setdefault(li, {})[name] = x.detach().clone()
            return
        ref = self.reference.get(li, {}).get(name)
        if ref is None:  # the exact run always executes every sub-layer; guard anyway
            return
        cos = token_cosines(ref, x)
        self.sums.setdefault(li, {}).setdefault(name, 0.0)
        self.tokens.setdefault(li, {}).setdefault(name, 0)
        self.sums[li][name] += float(cos.sum())
        self.tokens[li][name] += int(cos.numel())

    def attn_input(self, li: int, h: torch.Tensor) -> None:
        self._put(li, "h", h)

    def attn(self, li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
        self._put(li, "q", _flat(q))
        self._put(li, "k", _flat(k))
        self._put(li, "v", _flat(v))
        self._put(li, "attn", out)


def fuzzy_layers(plan: LayerPlan) -> list[int]:
    """Group members whose attention input differs under the plan: all but each group's first
    layer, executed attention only."""
    skip = set(plan.skip_attn)
    return [li for first, last in plan.groups for li in range(first + 1, last + 1) if li not in skip]


def _check(lm: CausalLM, prompts: list[list[int]], lp_sizes: list[int]) -> None:
    n = lm.dims.n_layers
    if not prompts:
        raise RuntimeUserError("diagnose needs at least one prompt")
    if not lp_sizes:
        raise RuntimeUserError("diagnose needs at least one layer-parallel size (--lp-size)")
    for lp in lp_sizes:
        if isinstance(lp, bool) or not isinstance(lp, int) or not 1 <= lp <= n:
            raise RuntimeUserError(f"layer-parallel size {lp!r} is out of range: the model has {n} layers, use 2..{n}")
        if lp > 1 and not easyspec_plan(n, lp).groups:
            raise RuntimeUserError(
                f"the model has only {n} layers: EasySpec plans (layer 0 and the last layer alone) need at least 4"
            )
    for i, ids in enumerate(prompts):
        if len(ids) == 0:
            raise RuntimeUserError(f"prompt {i} is empty after tokenization")
        if len(ids) > lm.dims.max_positions:
            raise RuntimeUserError(
                f"prompt {i} has {len(ids)} tokens, which exceeds the model context of {lm.dims.max_positions}; "
                "shorten the prompt"
            )


@torch.inference_mode()
def _run(
    lm: CausalLM, ids: list[int], plan: LayerPlan | None, recorder: StateRecorder, cache: KVCache,
    exact_prefix: bool = False,
) -> torch.Tensor:
    """One forward of ``ids`` under ``plan`` with ``recorder`` attached -> argmax per position.

    ``exact_prefix``: ``cache`` already holds the exact run's K/V for ``ids`` at slots
    ``[0, T)``; the tokens run again at positions ``0..T-1`` into slots ``[T, 2T)`` and token ``t``
    attends to the exact slots ``[0, t)`` and its own (fuzzy) slot ``T + t``: every position is a
    fuzzy forward over an exact prefix, in one pass."""
    t = len(ids)
    tokens = torch.tensor(ids, dtype=torch.long, device=lm.device)
    positions = mask = None
    if exact_prefix:
        cache.rollback(t)
        positions = torch.arange(t, device=lm.device)
        mask = torch.zeros(t, 2 * t, dtype=torch.bool, device=lm.device)
        mask[:, :t] = torch.ones(t, t, dtype=torch.bool, device=lm.device).tril(-1)
        mask[:, t:] = torch.eye(t, dtype=torch.bool, device=lm.device)
    lm.recorder = recorder
    try:
        logits = lm(tokens, cache, Layout.explicit(mask, positions), plan=plan)
    finally:
        lm.recorder = None
    return logits.argmax(-1)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


class _Totals:
    """Cosine sums and token counts per layer and state, and top-1 agreements, of one variant."""

    def __init__(self, n_layers: int) -> None:
        self.sums = {li: dict.fromkeys(STATES, 0.0) for li in range(n_layers)}
        self.counts = {li: dict.fromkeys(STATES, 0) for li in range(n_layers)}
        self.agree = 0

    def add(self, rec: StateRecorder, top: torch.Tensor, exact_top: torch.Tensor) -> None:
        self.agree += int((top == exact_top).sum())
        for li, by_state in rec.sums.items():
            for s, v in by_state.items():
                self.sums[li][s] += v
                self.counts[li][s] += rec.tokens[li][s]

    def summary(self, layers: list[int], tokens: int) -> dict[str, Any]:
        n = len(self.sums)
        per_layer = {
            li: {s: self.sums[li][s] / self.counts[li][s] for s in STATES if self.counts[li][s]} for li in range(n)
        }
        return {
            "fuzzy": {s: _mean([per_layer[li][s] for li in layers if s in per_layer[li]]) for s in STATES},
            "all": {s: _mean([per_layer[li][s] for li in range(n) if s in per_layer[li]]) for s in STATES},
            "top1": self.agree / tokens,
            "per_layer": per_layer,
        }


def diagnose(lm: CausalLM, prompts: list[list[int]], lp_sizes: list[int] | tuple[int, ...] = (2, 3, 4)) -> dict[str, Any]:
    """EasySpec table 5 for ``lm``: for each layer-parallel size ``N``, the mean cosine similarity
    between exact and fuzzy attention states over ``prompts`` (token id lists). See the module doc.

    Returns ``{"n_layers", "prompts", "tokens", "setup", "lp": {N: {"plan", "fuzzy_layers",
    "fuzzy": {state: mean}, "all": {state: mean}, "top1", "per_layer": {layer: {state: mean}},
    "exact_prefix": {"fuzzy", "all", "top1", "per_layer"}}}}`` (``fuzzy`` values are NaN when the
    plan has no fuzzy layer, e.g. ``N = 1``). The top level of each ``N`` is the fuzzy-throughout
    run; ``exact_prefix`` the run over the exact prefix K/V."""
    lp_sizes = list(lp_sizes)
    _check(lm, prompts, lp_sizes)
    n = lm.dims.n_layers
    plans = {lp: easyspec_plan(n, lp) for lp in lp_sizes}
    throughout = {lp: _Totals(n) for lp in lp_sizes}
    calibrated = {lp: _Totals(n) for lp in lp_sizes}
    total = 0
    for ids in prompts:
        exact = StateRecorder()
        exact_cache = lm.new_cache(2 * len(ids))
        exact_top = _run(lm, ids, None, exact, exact_cache)
        total += len(ids)
        for lp, plan in plans.items():
            rec = StateRecorder(reference=exact.states)
            throughout[lp].add(rec, _run(lm, ids, plan, rec, lm.new_cache(len(ids))), exact_top)
            rec = StateRecorder(reference=exact.states)
            calibrated[lp].add(rec, _run(lm, ids, plan, rec, exact_cache, exact_prefix=True), exact_top)
    out: dict[str, Any] = {"n_layers": n, "prompts": len(prompts), "tokens": total, "setup": SETUP, "lp": {}}
    for lp, plan in plans.items():
        layers = fuzzy_layers(plan)
        out["lp"][lp] = {
            "plan": plan.to_dict(), "fuzzy_layers": layers, **throughout[lp].summary(layers, total),
            "exact_prefix": calibrated[lp].summary(layers, total),
        }
    return out


def _f(x: float) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.3f}"


def format_table(report: dict[str, Any], title: str = "") -> str:
    """Our table 5 (fuzzy layers, fuzzy throughout) beside EasySpec's published one, then the
    exact-prefix variant and the all-layers variants."""
    from rich.console import Console
    from rich.table import Table

    name = title or "this model"

    def table(caption: str, paper: bool = False) -> Table:
        t = Table(title=caption)
        t.add_column("LP size", justify="right")
        if not paper:
            t.add_column("layers", justify="right")
        for s in STATES:
            t.add_column(STATE_TITLES[s], justify="right")
        if not paper:
            t.add_column("top-1 agree", justify="right")
        return t

    ours = table(f"{name}: fuzzy layers, fuzzy throughout")
    paper = table(f"EasySpec table 5 ({PAPER_MODEL})", paper=True)
    ours_cal = table(f"{name}: fuzzy layers, exact prefix K/V")
    every = table(f"{name}: all layers, fuzzy throughout")
    every_cal = table(f"{name}: all layers, exact prefix K/V")
    for lp, r in report["lp"].items():
        cal, n_fuzzy, n_all = r["exact_prefix"], str(len(r["fuzzy_layers"])), str(report["n_layers"])
        ours.add_row(str(lp), n_fuzzy, *(_f(r["fuzzy"][s]) for s in STATES), _f(r["top1"]))
        ours_cal.add_row(str(lp), n_fuzzy, *(_f(cal["fuzzy"][s]) for s in STATES), _f(cal["top1"]))
        every.add_row(str(lp), n_all, *(_f(r["all"][s]) for s in STATES), _f(r["top1"]))
        every_cal.add_row(str(lp), n_all, *(_f(cal["all"][s]) for s in STATES), _f(cal["top1"]))
    for lp, row in PAPER_TABLE5.items():
        paper.add_row(str(lp), *(f"{row[s]:.2f}" for s in STATES))
    console = Console(width=170, record=True)
    with console.capture() as cap:
        for left, right in ((ours, paper), (ours_cal, None), (every, every_cal)):
            grid = Table.grid(padding=(0, 3))
            grid.add_row(*(t for t in (left, right) if t is not None))
            console.print(grid)
        console.print(
            f"{report['prompts']} prompt(s), {report['tokens']} tokens, {report['n_layers']} layers. "
            f"Setup: {report['setup']}. top-1 agree: next-token argmax equal to the exact run's.",
            soft_wrap=True,
        )
    return cap.get()
