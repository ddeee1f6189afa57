"""Search spaces: families of strategies encoded as Optuna parameters.

A space turns a trial into a valid ``Strategy`` (``define``, define-by-run: it works with any
``optuna.trial.Trial``, ``FixedTrial`` included) and a strategy back into the parameters that
reproduce it (``encode``, for ``study.enqueue_trial`` and ``FixedTrial``). Fields a space does not
tune come from ``SpaceContext.base``.

Parameters shared by several spaces:

- ``draft_length`` (int ``2..max_draft_length``): tokens drafted per round (gamma).
- ``confidence_threshold`` (float ``0..0.9``, step 0.05): SWIFT's early stop of a draft chain once
  the draft's top-1 probability falls below it; 0 disables.

Spaces that do not tune the tree keep the base's shape: its ``dynamic_widths`` as they are, its
``tree_widths`` cut or padded with 1s to the drafted length.

The layer-skip spaces follow SWIFT (section 4.1): a fixed skip ratio ``r`` and a search over which
attention/MLP sub-layers of layers ``1..n-2`` are skipped (first and last layers always run);
SWIFT proposes candidates by random search with a Bayesian-optimisation step every beta-th step,
which the tuner reproduces with Optuna samplers over these parameters. ``easyspec`` searches
EasySpec's layer-parallel plans (appendix B: the paper notes the best plan depends on model and data).
"""
from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

from search_spaces.errors import SpaceError, StrategyError
from search_spaces.layer_plan import LayerPlan, easyspec_plan, uniform_skip_plan
from search_spaces.strategy import MAX_TREE_NODES, PLAIN, SWIFT_DYNAMIC_WIDTHS, Strategy, tree_node_bound

if TYPE_CHECKING:  # optuna is imported only when a space is used: `import search_spaces` stays light
    import optuna

MIN_DRAFT_LENGTH = 2
# SWIFT's maximum draft length N_D; also the longest chain whose swift-dynamic tree fits MAX_TREE_NODES
MAX_SPACE_DRAFT_LENGTH = MAX_TREE_NODES // max(k for _, k in SWIFT_DYNAMIC_WIDTHS)
MAX_THRESHOLD, THRESHOLD_STEP = 0.9, 0.05
# the grid ``SearchSpace.sweep`` scores a family on (and the `chain` space's points)
CHAIN_LENGTHS = SWEEP_LENGTHS = (2, 4, 6, 8, 10, 12)
CHAIN_THRESHOLDS = SWEEP_THRESHOLDS = (0.0, 0.3, 0.6)
SWEEP_HEADS = ((1, 1), (2, 1), (2, 2))  # tree widths at depths 1 and 2 (then a chain)
MAX_LP_SIZE = 4

# tree menu of the `draft` space: name -> (leading tree widths, then 1s up to draft_length; dynamic table).
# "chain" is no tree; "swift-dynamic" is a chain offering SWIFT's confidence-dependent top-k per position.
TREE_SHAPES: dict[str, tuple[tuple[int, ...] | None, tuple[tuple[float, int], ...] | None]] = {
    "chain": (None, None),
    "2-1": ((2,), None),
    "2-2-1": ((2, 2), None),
    "4-2-1": ((4, 2), None),
    "swift-dynamic": (None, SWIFT_DYNAMIC_WIDTHS),
}


@dataclass(frozen=True)
class SpaceContext:
    """What a space needs besides the trial.

    - ``n_layers``: layers of the model whose plan is tuned (the target for ``layer-skip*``, the
      draft model for ``easyspec``).
    - ``base``: the strategy supplying every field the space does not tune.
    - ``skip_ratio``: SWIFT's fixed skip ratio r of the ``layer-skip`` space (and of the uniform
      reference plan of both layer-skip spaces).
    - ``max_draft_length``: upper bound of the ``draft_length`` parameter (2..25).
    """

    n_layers: int
    base: Strategy = Strategy()
    skip_ratio: float = 0.45
    max_draft_length: int = 12
    draft_layers: int | None = None  # `auto`: layers of the draft model (None: no draft model)

    def __post_init__(self) -> None:
        if isinstance(self.n_layers, bool) or not isinstance(self.n_layers, int) or self.n_layers < 1:
            raise SpaceError(f"n_layers={self.n_layers!r} must be a positive integer")
        d = self.draft_layers
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise SpaceError(f"draft_layers={d!r} must be a positive integer or None")
        if not isinstance(self.base, Strategy):
            raise SpaceError(f"base={self.base!r} must be a Strategy")
        r = self.skip_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 <= r < 1.0:
            raise SpaceError(f"skip_ratio={r!r} must be a number in [0, 1)")
        m = self.max_draft_length
        if isinstance(m, bool) or not isinstance(m, int) or not MIN_DRAFT_LENGTH <= m <= MAX_SPACE_DRAFT_LENGTH:
            raise SpaceError(
                f"max_draft_length={m!r} must be an integer in {MIN_DRAFT_LENGTH}..{MAX_SPACE_DRAFT_LENGTH}"
            )
        try:  # node counts grow with the length: the base's tree shape must fit at the longest draft
            replace(self.base, draft_length=m, tree_widths=_fit_widths(self.base.tree_widths, m))
        except StrategyError as exc:
            raise SpaceError(f"the base strategy's tree shape does not fit max_draft_length={m}: {exc}") from exc


class SearchSpace(ABC):
    """A family of strategies as Optuna parameters.

    ``conditional`` is True when some parameters exist only for some values of others (the tuner
    then uses TPE rather than GPSampler for its Bayesian steps).
    """

    name: str
    drafter: str
    conditional: bool = False

    @abstractmethod
    def define(self, trial: optuna.trial.BaseTrial, ctx: SpaceContext) -> Strategy:
        """Suggest this space's parameters on ``trial`` and return the strategy they give."""

    @abstractmethod
    def _params(self, strategy: Strategy, ctx: SpaceContext) -> dict[str, Any]:
        """Parameters meant to reproduce ``strategy`` (may hold some that ``define`` does not ask)."""

    @abstractmethod
    def _reference_params(self, ctx: SpaceContext) -> dict[str, Any]:
        """Parameters of the untuned reference strategy."""

    def kinds(self, ctx: SpaceContext) -> tuple[str, ...]:
        """The drafter kinds of this space's strategies (in this context)."""
        return (self.drafter,)

    def encode(self, strategy: Strategy, ctx: SpaceContext) -> dict[str, Any]:
        """The parameters ``define`` needs to reproduce ``strategy`` exactly; ``SpaceError`` when
        ``strategy`` is not a point of this space (in this context). A draft model's identity
        layer plan counts as no plan."""
        return self.encode_trial(strategy, ctx)[0]

    def encode_trial(self, strategy: Strategy, ctx: SpaceContext) -> tuple[dict[str, Any], dict[str, Any]]:
        """``encode``, with the distributions of those parameters: what a finished trial of
        ``strategy`` needs (``optuna.trial.create_trial``)."""
        if strategy.drafter not in self.kinds(ctx):
            raise SpaceError(
                f"space '{self.name}' holds {' / '.join(self.kinds(ctx))} strategies, not drafter '{strategy.drafter}'"
            )
        plan = strategy.layer_plan
        if strategy.drafter == "draft-model" and plan is not None and plan.is_identity:
            strategy = replace(strategy, layer_plan=None)
        params = self._params(strategy, ctx)
        trial, rebuilt = self._replay(params, ctx)
        outside = [n for n, d in trial.distributions.items() if not d._contains(d.to_internal_repr(params[n]))]
        if rebuilt != strategy or outside:
            differ = [f.name for f in fields(Strategy) if getattr(rebuilt, f.name) != getattr(strategy, f.name)]
            raise SpaceError(
                f"strategy is not a point of space '{self.name}': {', '.join(differ + outside)} outside what "
                "its parameters can give (fields it does not tune must equal the context's base)"
            )
        return {name: params[name] for name in trial.params}, dict(trial.distributions)

    def uniform(self, ctx: SpaceContext) -> Strategy:
        """The untuned reference strategy of this space."""
        return self._replay(self._reference_params(ctx), ctx)[1]

    def seeds(self, ctx: SpaceContext) -> list[Strategy]:
        """Points the online tuner scores first (before random and Bayesian proposals)."""
        return [self.uniform(ctx)]

    def neighbours(self, strategy: Strategy, ctx: SpaceContext) -> list[Strategy]:
        """Points of the space next to ``strategy`` with the same drafter and layer plan: draft
        length +-2, confidence threshold +-0.1 (where the space has them). Scoring them reuses the
        window's matchness of that plan, so they are the cheapest candidates that can change a
        decision (a local step after random and Bayesian proposals)."""
        if not strategy.speculates:
            return []
        changes: list[dict[str, Any]] = [
            {"draft_length": strategy.draft_length - 2}, {"draft_length": strategy.draft_length + 2},
        ]
        if strategy.drafter != "prompt-lookup":
            changes += [{"confidence_threshold": round(strategy.confidence_threshold + d, 2)} for d in (-0.1, 0.1)
                        if strategy.confidence_threshold + d >= 0.0]
            # one more or one fewer candidate at the first depth (a chain becomes a small tree)
            widths = strategy.tree_widths or (1,) * strategy.draft_length
            for w in (widths[0] - 1, widths[0] + 1):
                if w >= 1:
                    head = (w, *widths[1:])
                    changes.append({"tree_widths": None if all(x == 1 for x in head) else head})
        out = []
        for change in changes:
            if strategy.tree_widths is not None and "draft_length" in change:
                change = {**change, "tree_widths": _fit_widths(strategy.tree_widths, change["draft_length"])}
            try:
                near = replace(strategy, **change)
            except StrategyError:
                continue
            if "tree_widths" in change and "draft_length" not in change:  # a wider tree is cut to the space's node budget, as define() does
                near = next((c for c in _shorter(near) if self._holds(c, ctx)), None)
            elif not self._holds(near, ctx):
                near = None
            if near is not None and near != strategy and near not in out:
                out.append(near)
        return out

    def sweep(self, strategy: Strategy, ctx: SpaceContext) -> list[Strategy]:
        """``strategy``'s family on a grid: the points of the space with its drafter and layer plan
        at every ``SWEEP_LENGTHS`` length up to ``max_draft_length`` (and that; prompt lookup at every
        length), every ``SWEEP_THRESHOLDS``
        threshold and every ``SWEEP_HEADS`` tree head (the last two where the drafter has them),
        a draft model's with ``lookup_first`` off and on.
        Once the plan's matches on a window are cached, scoring the whole family there is
        arithmetic, no forward: the tuner scores it on every fresh window."""
        if not strategy.speculates:
            return []
        lengths = sorted({n for n in SWEEP_LENGTHS if n <= ctx.max_draft_length} | {ctx.max_draft_length})
        if strategy.drafter == "prompt-lookup":  # token arithmetic only: every length (row-blocked kernels price them unevenly)
            grid = [replace(strategy, draft_length=n) for n in range(MIN_DRAFT_LENGTH, ctx.max_draft_length + 1)]
        else:
            grid = []
            copying = (False, True) if strategy.drafter == "draft-model" else (False,)
            for head in SWEEP_HEADS:
                for n in lengths:
                    widths = _fit_widths(head, n)
                    for t in SWEEP_THRESHOLDS:
                        for lookup_first in copying:
                            try:
                                grid.append(replace(strategy, draft_length=n, confidence_threshold=t,
                                                    dynamic_widths=None, lookup_first=lookup_first,
                                                    tree_widths=None if all(w == 1 for w in widths) else widths))
                            except StrategyError:
                                continue
        out: list[Strategy] = []
        for s in grid:
            if s not in out and self._holds(s, ctx):
                out.append(s)
        return out

    def _holds(self, strategy: Strategy, ctx: SpaceContext) -> bool:
        try:
            self.encode(strategy, ctx)
        except (SpaceError, StrategyError):
            return False
        return True

    def _replay(self, params: dict[str, Any], ctx: SpaceContext) -> tuple[optuna.trial.FixedTrial, Strategy]:
        from optuna.trial import FixedTrial

        trial = FixedTrial(params)
        try:
            with warnings.catch_warnings():  # out-of-range values are reported by encode
                warnings.simplefilter("ignore")
                return trial, self.define(trial, ctx)
        except SpaceError:
            raise
        except ValueError as exc:
            raise SpaceError(f"parameters {params} are not a point of space '{self.name}': {exc}") from exc


# ---------------------------------------------------------------------------------- shared pieces
def _shorter(strategy: Strategy):
    """``strategy``, then the same tree cut one depth shorter each time (down to 2)."""
    for n in range(strategy.draft_length, MIN_DRAFT_LENGTH - 1, -1):
        widths = _fit_widths(strategy.tree_widths, n)
        try:
            yield replace(strategy, draft_length=n, tree_widths=widths)
        except StrategyError:
            continue


def _fit_widths(widths: tuple[int, ...] | None, length: int) -> tuple[int, ...] | None:
    """``widths`` cut or padded with 1s to ``length`` depths (``None`` stays a chain)."""
    return None if widths is None else (tuple(widths) + (1,) * length)[:length]


def _suggest_length(trial: optuna.trial.BaseTrial, ctx: SpaceContext) -> int:
    return trial.suggest_int("draft_length", MIN_DRAFT_LENGTH, ctx.max_draft_length)


def _suggest_threshold(trial: optuna.trial.BaseTrial) -> float:
    # Optuna's stepped floats carry binary noise (0.35000000000000003); strategies hold the step value
    return round(trial.suggest_float("confidence_threshold", 0.0, MAX_THRESHOLD, step=THRESHOLD_STEP), 2)


def _drafting(trial: optuna.trial.BaseTrial, ctx: SpaceContext, tree: Any = None, **changes: Any) -> Strategy:
    """The base with tuned draft length and threshold, ``changes``, and ``tree`` (a ``TREE_SHAPES``
    value; default the base's shape) with its widths fitted to the length."""
    length = _suggest_length(trial, ctx)
    head, dynamic = tree or (ctx.base.tree_widths, ctx.base.dynamic_widths)
    return replace(ctx.base, draft_length=length, confidence_threshold=_suggest_threshold(trial),
                   tree_widths=_fit_widths(head, length), dynamic_widths=dynamic, **changes)


def _drafting_params(s: Strategy) -> dict[str, Any]:
    return {"draft_length": s.draft_length, "confidence_threshold": s.confidence_threshold}


def _reference_drafting(ctx: SpaceContext) -> dict[str, Any]:
    """The base's draft length and threshold moved to the nearest values the spaces allow."""
    b = ctx.base
    threshold = round(min(max(round(b.confidence_threshold / THRESHOLD_STEP) * THRESHOLD_STEP, 0.0), MAX_THRESHOLD), 2)
    return {"draft_length": min(max(b.draft_length, MIN_DRAFT_LENGTH), ctx.max_draft_length),
            "confidence_threshold": threshold}


def _sublayers(ctx: SpaceContext) -> list[tuple[int, str]]:
    """Skippable sub-layers in index order: (1, attn), (1, mlp), ..., (n-2, mlp)."""
    if ctx.n_layers < 3:
        raise SpaceError(f"layer-skip spaces need a model of at least 3 layers, got n_layers={ctx.n_layers}")
    return [(i, kind) for i in range(1, ctx.n_layers - 1) for kind in ("attn", "mlp")]


def _skip_plan(ctx: SpaceContext, skipped: list[tuple[int, str]]) -> LayerPlan:
    return LayerPlan(
        n_layers=ctx.n_layers,
        skip_attn=tuple(sorted(i for i, kind in skipped if kind == "attn")),
        skip_mlp=tuple(sorted(i for i, kind in skipped if kind == "mlp")),
    )


def _skipped(plan: LayerPlan | None) -> set[tuple[int, str]]:
    if plan is None:
        return set()
    return {(i, "attn") for i in plan.skip_attn} | {(i, "mlp") for i in plan.skip_mlp}


# ---------------------------------------------------------------------------------- the spaces
class LayerSkipSpace(SearchSpace):
    """SWIFT self-speculation at a fixed skip ratio.

    ``s_attn_{i}`` / ``s_mlp_{i}`` (float 0..1, layers i = 1..n-2): a score per sub-layer; the
    ``skip_count`` highest scores are skipped (ties: lower layer first, attention before MLP).
    Continuous, so GPSampler applies. Plus ``draft_length`` and ``confidence_threshold``.
    """

    name, drafter = "layer-skip", "layer-skip"

    @staticmethod
    def skip_count(ctx: SpaceContext) -> int:
        """``round(r * 2 * n_layers)`` sub-layers, clipped to 1..the skippable ones."""
        return max(1, min(len(_sublayers(ctx)), round(ctx.skip_ratio * 2 * ctx.n_layers)))

    def define(self, trial: optuna.trial.BaseTrial, ctx: SpaceContext) -> Strategy:
        subs = _sublayers(ctx)
        scores = [trial.suggest_float(f"s_{kind}_{i}", 0.0, 1.0) for i, kind in subs]
        top = sorted(range(len(subs)), key=lambda j: (-scores[j], j))[: self.skip_count(ctx)]
        return _drafting(trial, ctx, drafter=self.drafter, layer_plan=_skip_plan(ctx, [subs[j] for j in top]))

    def _params(self, strategy: Strategy, ctx: SpaceContext) -> dict[str, Any]:
        return {**self._scores(strategy.layer_plan, ctx), **_drafting_params(strategy)}

    def _reference_params(self, ctx: SpaceContext) -> dict[str, Any]:
        # SWIFT's uniform whole-layer skip; where its 2*round(r*n) sub-layers differ from the fixed
        # count, the score ranking above drops/adds one sub-layer
        return {**self._scores(uniform_skip_plan(ctx.n_layers, ctx.skip_ratio), ctx), **_reference_drafting(ctx)}

    @staticmethod
    def _scores(plan: LayerPlan | None, ctx: SpaceContext) -> dict[str, float]:
        skipped = _skipped(plan)
        return {f"s_{kind}_{i}": 1.0 if (i, kind) in skipped else 0.0 for i, kind in _sublayers(ctx)}


class LayerSkipFreeSpace(SearchSpace):
    """SWIFT layer skipping without a fixed count.

    ``skip_attn_{i}`` / ``skip_mlp_{i}`` (int 0/1, layers i = 1..n-2): 1 skips that sub-layer.
    A trial skipping nothing (not a valid self-drafter) skips the attention of layer ``n // 2``.
    Plus ``draft_length`` and ``confidence_threshold``.
    """

    name, drafter = "layer-skip-free", "layer-skip"

    def define(self, trial: optuna.trial.BaseTrial, ctx: SpaceContext) -> Strategy:
        skipped = [(i, kind) for i, kind in _sublayers(ctx) if trial.suggest_int(f"skip_{kind}_{i}", 0, 1)]
        plan = _skip_plan(ctx, skipped or [(ctx.n_layers // 2, "attn")])
        return _drafting(trial, ctx, drafter=self.drafter, layer_plan=plan)

    def _params(self, strategy: Strategy, ctx: SpaceContext) -> dict[str, Any]:
        return {**self._flags(strategy.layer_plan, ctx), **_drafting_params(strategy)}

    def _reference_params(self, ctx: SpaceContext) -> dict[str, Any]:
        return {**self._flags(uniform_skip_plan(ctx.n_layers, ctx.skip_ratio), ctx), **_reference_drafting(ctx)}

    @staticmethod
    def _flags(plan: LayerPlan | None, ctx: SpaceContext) -> dict[str, int]:
        skipped = _skipped(plan)
        return {f"skip_{kind}_{i}": int((i, kind) in skipped) for i, kind in _sublayers(ctx)}


def lp_groups(n_layers: int, lp_size: int, first_size: int) -> tuple[tuple[int, int], ...]:
    """EasySpec-style layer-parallel groups: layer 0 and the last layer alone, a first group of
    ``first_size`` layers from layer 1, then groups of ``lp_size``, the remainder before the last
    layer as the final group (one-layer "groups" run normally). ``first_size = min(lp_size, 3)``
    gives ``easyspec_plan``."""
    groups: list[tuple[int, int]] = []
    start, size = 1, first_size
    while start <= n_layers - 2:
        last = min(start + size - 1, n_layers - 2)
        if last > start:
            groups.append((start, last))
        start, size = last + 1, lp_size
    return tuple(groups)


class EasySpecSpace(SearchSpace):
    """A draft model with EasySpec layer-parallel (fuzzy) groups.

    - ``lp_size`` (int 1..4): layers per group; 1 = no groups.
    - ``first_size`` (int 1..lp_size, only when lp_size > 1): size of the first group after layer
      0, i.e. where the group boundaries fall (see ``lp_groups``).
    - ``calibrate`` (True/False, only when the plan has groups): EasySpec's bonus calibration;
      without groups it comes from the base.
    - ``draft_length``, ``confidence_threshold``.
    """

    name, drafter, conditional = "easyspec", "draft-model", True

    def define(self, trial: optuna.trial.BaseTrial, ctx: SpaceContext) -> Strategy:
        lp_size = trial.suggest_int("lp_size", 1, MAX_LP_SIZE)
        first_size = trial.suggest_int("first_size", 1, lp_size) if lp_size > 1 else 1
        groups = lp_groups(ctx.n_layers, lp_size, first_size)
        if not groups:
            return _drafting(trial, ctx, drafter=self.drafter, layer_plan=None)
        calibrate = trial.suggest_categorical("calibrate", [True, False])
        plan = LayerPlan(n_layers=ctx.n_layers, groups=groups)
        return _drafting(trial, ctx, drafter=self.drafter, layer_plan=plan, calibrate=calibrate)

    def _params(self, strategy: Strategy, ctx: SpaceContext) -> dict[str, Any]:
        groups = () if strategy.layer_plan is None else strategy.layer_plan.groups
        return {**self._sizes(groups, ctx), "calibrate": strategy.calibrate, **_drafting_params(strategy)}

    def _reference_params(self, ctx: SpaceContext) -> dict[str, Any]:
        groups = easyspec_plan(ctx.n_layers, MAX_LP_SIZE).groups  # EasySpec's default N=4, with calibration
        return {**self._sizes(groups, ctx), "calibrate": True, **_reference_drafting(ctx)}

    def _sizes(self, groups: tuple[tuple[int, int], ...], ctx: SpaceContext) -> dict[str, int]:
        for lp_size in range(1, MAX_LP_SIZE + 1):
            for first_size in range(1, lp_size + 1):
                if lp_groups(ctx.n_layers, lp_size, first_size) == groups:
                    return {"lp_size": lp_size, "first_size": first_size}
        raise SpaceError(f"layer_plan groups {[list(g) for g in groups]} are not a plan of space '{self.name}'")


class DraftSpace(SearchSpace):
    """A draft model running all its layers.

    - ``tree`` (one of ``TREE_SHAPES``): ``chain``; ``2-1`` / ``2-2-1`` / ``4-2-1`` = those widths
      at the first depths, then 1s up to ``draft_length``; ``swift-dynamic`` = a chain with SWIFT's
      dynamic verification table.
    - ``draft_length``, ``confidence_threshold``.
    """

    name, drafter = "draft", "draft-model"

    def define(self, trial: optuna.trial.BaseTrial, ctx: SpaceContext) -> Strategy:
        tree = TREE_SHAPES[trial.suggest_categorical("tree", list(TREE_SHAPES))]
        return _drafting(trial, ctx, tree=tree, drafter=self.drafter, layer_plan=None)

    def _params(self, strategy: Strategy, ctx: SpaceContext) -> dict[str, Any]:
        tree = _tree_name(strategy.tree_widths, strategy.dynamic_widths, strategy.draft_length)
        if tree is None:
            raise SpaceError(
                f"tree_widths={strategy.tree_widths} / dynamic_widths={strategy.dynamic_widths} is not in the "
                f"tree menu of space '{self.name}' ({', '.join(TREE_SHAPES)})"
            )
        return {"tree": tree, **_drafting_params(strategy)}

    def _reference_params(self, ctx: SpaceContext) -> dict[str, Any]:
        drafting, b = _reference_drafting(ctx), ctx.base
        length = drafting["draft_length"]  # the base's tree at this length if the menu has it, else a chain
        return {"tree": _tree_name(_fit_widths(b.tree_widths, length), b.dynamic_widths, length) or "chain", **drafting}


def _tree_name(widths: tuple[int, ...] | None, dynamic: Any, length: int) -> str | None:
    """The menu name of this tree shape at ``length`` depths, if any."""
    for name, (head, menu_dynamic) in TREE_SHAPES.items():
        if (_fit_widths(head, length), menu_dynamic) == (widths, dynamic):
            return name
    return None


class LookupSpace(SearchSpace):
    """Prompt lookup (copy the continuation of the latest matching n-gram): ``draft_length`` only."""

    name, drafter = "lookup", "prompt-lookup"

    def define(self, trial: optuna.trial.BaseTrial, ctx: SpaceContext) -> Strategy:
        return replace(ctx.base, drafter=self.drafter, draft_length=_suggest_length(trial, ctx),
                       tree_widths=None, dynamic_widths=None, layer_plan=None)

    def _params(self, strategy: Strategy, ctx: SpaceContext) -> dict[str, Any]:
        return {"draft_length": strategy.draft_length}

    def _reference_params(self, ctx: SpaceContext) -> dict[str, Any]:
        return {"draft_length": _reference_drafting(ctx)["draft_length"]}


class _Prefixed:
    """A trial whose parameter names get a prefix: one branch of the joint space reuses a named
    space's parameters without sharing names (or distributions) with the other branches."""

    def __init__(self, trial: optuna.trial.BaseTrial, prefix: str) -> None:
        self._trial, self._prefix = trial, prefix

    def suggest_int(self, name: str, *args: Any, **kwargs: Any) -> int:
        return self._trial.suggest_int(self._prefix + name, *args, **kwargs)

    def suggest_float(self, name: str, *args: Any, **kwargs: Any) -> float:
        return self._trial.suggest_float(self._prefix + name, *args, **kwargs)

    def suggest_categorical(self, name: str, choices: Any) -> Any:
        return self._trial.suggest_categorical(self._prefix + name, choices)


def _prefixed(params: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {prefix + k: v for k, v in params.items()}


MAX_HEAD_WIDTHS = (4, 2)  # `auto` trees: children per node at depth 1 and 2 (then a chain)
TREE_SEED_LENGTH = 4  # depth of the `auto` space's seed tree (2 candidates at depth 1, then chains)


class AutoSpace(SearchSpace):
    """One joint space over the drafter kind and everything that applies to it (the default).

    - ``drafter`` (categorical): ``none`` (plain decoding), ``prompt-lookup``, and the context's
      drafting model: ``draft-model`` when the study has a draft model (``ctx.draft_layers``),
      otherwise ``layer-skip`` (the target skipping sub-layers, SWIFT).
    - ``draft-model`` (``dm_*``): EasySpec layer-parallel groups (``dm_lp_size``, ``dm_first_size``),
      bonus calibration (``dm_calibrate``, only with groups), the tree widths of the first two
      depths (``dm_w1`` 1..4, ``dm_w2`` 1..2; deeper: a chain), ``dm_draft_length``,
      ``dm_confidence_threshold``, ``dm_lookup`` (prompt lookup first where an n-gram recurs:
      ``Strategy.lookup_first``). A tree never has more nodes than ``max_draft_length``: the
      length is cut to fit, so every strategy shares one verify width.
    - ``layer-skip`` (``ls_*``): the ``layer-skip`` space's parameters (fixed skip ratio).
    - ``prompt-lookup`` (``lk_*``): ``lk_draft_length``.

    Parameters are conditional (each branch's exist only for its kind) and prefixed per branch,
    so TPE's multivariate group mode models each kind's subspace on its own. The named spaces
    stay as subsets of it. The reference point is plain decoding: the tuner's incumbent until a
    candidate beats it on measured time.
    """

    name, drafter, conditional = "auto", "auto", True

    def kinds(self, ctx: SpaceContext) -> tuple[str, ...]:
        if ctx.draft_layers:
            return ("none", "prompt-lookup", "draft-model")
        return ("none", "prompt-lookup", "layer-skip") if ctx.n_layers >= 3 else ("none", "prompt-lookup")

    def define(self, trial: optuna.trial.BaseTrial, ctx: SpaceContext) -> Strategy:
        kind = trial.suggest_categorical("drafter", list(self.kinds(ctx)))
        if kind == "none":
            return PLAIN
        if kind == "prompt-lookup":
            return SPACES["lookup"].define(_Prefixed(trial, "lk_"), ctx)
        if kind == "layer-skip":
            placeholder = LayerPlan(n_layers=ctx.n_layers, skip_attn=(ctx.n_layers // 2,))  # define() replaces it
            base = replace(ctx.base, drafter="layer-skip", layer_plan=placeholder, calibrate=True,
                           tree_widths=None, dynamic_widths=None)
            return SPACES["layer-skip"].define(_Prefixed(trial, "ls_"), replace(ctx, base=base))
        return self._draft_model(_Prefixed(trial, "dm_"), ctx)

    def _draft_model(self, trial: _Prefixed, ctx: SpaceContext) -> Strategy:
        assert ctx.draft_layers is not None
        lp_size = trial.suggest_int("lp_size", 1, MAX_LP_SIZE)
        first_size = trial.suggest_int("first_size", 1, lp_size) if lp_size > 1 else 1
        groups = lp_groups(ctx.draft_layers, lp_size, first_size)
        calibrate = trial.suggest_categorical("calibrate", [True, False]) if groups else True
        plan = LayerPlan(n_layers=ctx.draft_layers, groups=groups) if groups else None
        head = (trial.suggest_int("w1", 1, MAX_HEAD_WIDTHS[0]), trial.suggest_int("w2", 1, MAX_HEAD_WIDTHS[1]))
        length = _suggest_length(trial, ctx)
        # the node budget (one verify width for the whole space): a shorter tree, then narrower heads
        def fits(h: tuple[int, int], n: int) -> bool:
            return tree_node_bound(_fit_widths(h, n), None) <= ctx.max_draft_length

        while length > MIN_DRAFT_LENGTH and not fits(head, length):
            length -= 1
        while not fits(head, length):
            head = (head[0], head[1] - 1) if head[1] > 1 else (head[0] - 1, 1)
        widths = _fit_widths(head, length)
        return replace(
            ctx.base, drafter="draft-model", draft_length=length, confidence_threshold=_suggest_threshold(trial),
            tree_widths=None if all(w == 1 for w in widths) else widths, dynamic_widths=None,
            layer_plan=plan, calibrate=calibrate, lookup_first=trial.suggest_categorical("lookup", [False, True]),
        )

    def _params(self, strategy: Strategy, ctx: SpaceContext) -> dict[str, Any]:
        kind = strategy.drafter
        if kind == "none":
            return {"drafter": "none"}
        if kind == "prompt-lookup":
            return {"drafter": kind, **_prefixed(SPACES["lookup"]._params(strategy, ctx), "lk_")}
        if kind == "layer-skip":
            return {"drafter": kind, **_prefixed(SPACES["layer-skip"]._params(strategy, ctx), "ls_")}
        if ctx.draft_layers is None:
            raise SpaceError(f"space '{self.name}' has no draft model in this context")
        groups = () if strategy.layer_plan is None else strategy.layer_plan.groups
        sizes = EasySpecSpace()._sizes(groups, replace(ctx, n_layers=ctx.draft_layers))
        widths = strategy.tree_widths or (1,) * strategy.draft_length
        head = (tuple(widths) + (1, 1))[:2]
        return {"drafter": kind, **_prefixed({
            **sizes, "calibrate": strategy.calibrate, "w1": head[0], "w2": head[1], **_drafting_params(strategy),
            "lookup": strategy.lookup_first,
        }, "dm_")}

    def _reference_params(self, ctx: SpaceContext) -> dict[str, Any]:
        return {"drafter": "none"}

    def seeds(self, ctx: SpaceContext) -> list[Strategy]:
        """Reference points, so every drafter kind is scored early: the draft model's chain at the
        base's length and threshold, a small tree (2 candidates at depth 1, depth 4) and
        EasySpec's default plan (or SWIFT's uniform skip without a draft model), and prompt
        lookup at the base's length."""
        kinds = self.kinds(ctx)
        length = min(max(ctx.base.draft_length, MIN_DRAFT_LENGTH), ctx.max_draft_length)
        threshold = _reference_drafting(ctx)["confidence_threshold"]
        params = [{"drafter": "prompt-lookup", "lk_draft_length": length}]
        if "draft-model" in kinds:
            assert ctx.draft_layers is not None
            drafting = {"dm_w1": 1, "dm_w2": 1, "dm_draft_length": length, "dm_confidence_threshold": threshold,
                        "dm_lookup": False}
            easy = EasySpecSpace()._sizes(easyspec_plan(ctx.draft_layers, MAX_LP_SIZE).groups,
                                          replace(ctx, n_layers=ctx.draft_layers))
            params = [
                {"drafter": "draft-model", "dm_lp_size": 1, **drafting},
                # a small tree: where the draft agrees less, a second candidate per step pays
                {"drafter": "draft-model", "dm_lp_size": 1, **drafting, "dm_w1": 2,
                 "dm_draft_length": min(TREE_SEED_LENGTH, ctx.max_draft_length)},
                {"drafter": "draft-model", **_prefixed(easy, "dm_"), "dm_calibrate": True, **drafting},
                # prompt lookup where the context repeats itself, the draft model elsewhere
                {"drafter": "draft-model", "dm_lp_size": 1, **drafting, "dm_lookup": True},
            ] + params
        elif "layer-skip" in kinds:
            base = replace(ctx.base, drafter="layer-skip", layer_plan=uniform_skip_plan(ctx.n_layers, ctx.skip_ratio),
                           tree_widths=None, dynamic_widths=None)
            ref = LayerSkipSpace()._reference_params(replace(ctx, base=base))
            params = [{"drafter": "layer-skip", **_prefixed(ref, "ls_")}] + params
        return [self._replay(p, ctx)[1] for p in params]

    def max_nodes(self, ctx: SpaceContext) -> int:
        """The most draft nodes of any strategy of the space: its verify width is this + 1."""
        return ctx.max_draft_length




def _chain_lengths(ctx: SpaceContext) -> list[int]:
    return [n for n in CHAIN_LENGTHS if n <= ctx.max_draft_length] or [MIN_DRAFT_LENGTH]


class ChainSpace(SearchSpace):
    """A small grid (a few dozen points, enumerable): plain decoding, the draft model's chain or
    prompt lookup, at ``CHAIN_LENGTHS`` (capped by ``max_draft_length``) x ``CHAIN_THRESHOLDS``
    (the threshold only for the draft model). What the online tuner's pick is checked against by
    running every point (``points``)."""

    name, drafter, conditional = "chain", "chain", True

    def kinds(self, ctx: SpaceContext) -> tuple[str, ...]:
        return ("none", "draft-model", "prompt-lookup") if ctx.draft_layers else ("none", "prompt-lookup")

    def define(self, trial: optuna.trial.BaseTrial, ctx: SpaceContext) -> Strategy:
        kind = trial.suggest_categorical("drafter", list(self.kinds(ctx)))
        if kind == "none":
            return PLAIN
        lengths = _chain_lengths(ctx)
        if kind == "prompt-lookup":
            return replace(ctx.base, drafter=kind, draft_length=trial.suggest_categorical("lk_draft_length", lengths),
                           tree_widths=None, dynamic_widths=None, layer_plan=None)
        return replace(ctx.base, drafter=kind, draft_length=trial.suggest_categorical("dm_draft_length", lengths),
                       confidence_threshold=trial.suggest_categorical("dm_confidence_threshold", list(CHAIN_THRESHOLDS)),
                       tree_widths=None, dynamic_widths=None, layer_plan=None)

    def _params(self, strategy: Strategy, ctx: SpaceContext) -> dict[str, Any]:
        if strategy.drafter == "none":
            return {"drafter": "none"}
        if strategy.drafter == "prompt-lookup":
            return {"drafter": strategy.drafter, "lk_draft_length": strategy.draft_length}
        return {"drafter": strategy.drafter, "dm_draft_length": strategy.draft_length,
                "dm_confidence_threshold": strategy.confidence_threshold}

    def _reference_params(self, ctx: SpaceContext) -> dict[str, Any]:
        return {"drafter": "none"}

    def seeds(self, ctx: SpaceContext) -> list[Strategy]:
        """Plain decoding (the reference), then one point per drafter kind at the grid length
        nearest the base's (threshold: the grid's nearest to the base's), so the online tuner
        sweeps both free families (the draft model's chain and prompt lookup) from its first
        window, as it does in ``auto``."""
        lengths = _chain_lengths(ctx)
        length = min(lengths, key=lambda n: (abs(n - ctx.base.draft_length), -n))
        params: list[dict[str, Any]] = [{"drafter": "none"}]
        if "draft-model" in self.kinds(ctx):
            threshold = min(CHAIN_THRESHOLDS, key=lambda t: abs(t - ctx.base.confidence_threshold))
            params.append({"drafter": "draft-model", "dm_draft_length": length, "dm_confidence_threshold": threshold})
        params.append({"drafter": "prompt-lookup", "lk_draft_length": length})
        return [self._replay(p, ctx)[1] for p in params]

    def points(self, ctx: SpaceContext) -> list[Strategy]:
        """Every strategy of the space."""
        lengths = _chain_lengths(ctx)
        params = [{"drafter": "none"}]
        if "draft-model" in self.kinds(ctx):
            params += [{"drafter": "draft-model", "dm_draft_length": n, "dm_confidence_threshold": t}
                       for n in lengths for t in CHAIN_THRESHOLDS]
        params += [{"drafter": "prompt-lookup", "lk_draft_length": n} for n in lengths]
        return [self._replay(p, ctx)[1] for p in params]


SPACES: dict[str, SearchSpace] = {
    s.name: s for s in (AutoSpace(), LayerSkipSpace(), LayerSkipFreeSpace(), EasySpecSpace(), DraftSpace(), LookupSpace(),
                        ChainSpace())
}


def get_space(name: str) -> SearchSpace:
    """The registered space ``name``; ``SpaceError`` naming the known spaces otherwise."""
    try:
        return SPACES[name]
    except (KeyError, TypeError):
        raise SpaceError(f"unknown search space {name!r}; known spaces: {', '.join(SPACES)}") from None


def uniform_strategy(space_name: str, ctx: SpaceContext) -> Strategy:
    """The untuned reference of a space: SWIFT's uniform skip (``uniform_skip_plan``) for the
    layer-skip spaces, EasySpec's ``easyspec_plan(n, 4)`` with calibration for ``easyspec``, the
    base strategy for ``draft``/``lookup`` (its draft length and threshold moved into the space's
    ranges; a tree outside the menu becomes a chain)."""
    return get_space(space_name).uniform(ctx)
