"""The search-space base: ``SpaceContext`` (what a space needs besides the trial), ``SearchSpace``
(a family of strategies as Optuna parameters) and the parameters and helpers the spaces share
(``search_spaces.spaces`` describes them)."""
from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

from search_spaces.errors import SpaceError, StrategyError
from search_spaces.kinds import kind_of
from search_spaces.layer_plan import SKIP_RATIO
from search_spaces.strategy import MAX_TREE_NODES, SWIFT_DYNAMIC_WIDTHS, Strategy

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
    skip_ratio: float = SKIP_RATIO
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
            replace(self.base, draft_length=m, tree_widths=fit_widths(self.base.tree_widths, m))
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
        if kind_of(strategy.drafter).layer_plan == "optional" and plan is not None and plan.is_identity:
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
        if kind_of(strategy.drafter).model_drafts:
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
                change = {**change, "tree_widths": fit_widths(strategy.tree_widths, change["draft_length"])}
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
        kind = kind_of(strategy.drafter)
        if not kind.model_drafts:  # token arithmetic only: every length (row-blocked kernels price them unevenly)
            grid = [replace(strategy, draft_length=n) for n in range(MIN_DRAFT_LENGTH, ctx.max_draft_length + 1)]
        else:
            grid = []
            copying = (False, True) if kind.copies_first else (False,)
            for head in SWEEP_HEADS:
                for n in lengths:
                    widths = fit_widths(head, n)
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
        widths = fit_widths(strategy.tree_widths, n)
        try:
            yield replace(strategy, draft_length=n, tree_widths=widths)
        except StrategyError:
            continue


def fit_widths(widths: tuple[int, ...] | None, length: int) -> tuple[int, ...] | None:
    """``widths`` cut or padded with 1s to ``length`` depths (``None`` stays a chain)."""
    return None if widths is None else (tuple(widths) + (1,) * length)[:length]


def suggest_length(trial: optuna.trial.BaseTrial, ctx: SpaceContext) -> int:
    return trial.suggest_int("draft_length", MIN_DRAFT_LENGTH, ctx.max_draft_length)


def suggest_threshold(trial: optuna.trial.BaseTrial) -> float:
    # Optuna's stepped floats carry binary noise (0.35000000000000003); strategies hold the step value
    return round(trial.suggest_float("confidence_threshold", 0.0, MAX_THRESHOLD, step=THRESHOLD_STEP), 2)


def drafting(trial: optuna.trial.BaseTrial, ctx: SpaceContext, tree: Any = None, **changes: Any) -> Strategy:
    """The base with tuned draft length and threshold, ``changes``, and ``tree`` (a ``TREE_SHAPES``
    value; default the base's shape) with its widths fitted to the length."""
    length = suggest_length(trial, ctx)
    head, dynamic = tree or (ctx.base.tree_widths, ctx.base.dynamic_widths)
    return replace(ctx.base, draft_length=length, confidence_threshold=suggest_threshold(trial),
                   tree_widths=fit_widths(head, length), dynamic_widths=dynamic, **changes)


def drafting_params(s: Strategy) -> dict[str, Any]:
    return {"draft_length": s.draft_length, "confidence_threshold": s.confidence_threshold}


def reference_drafting(ctx: SpaceContext) -> dict[str, Any]:
    """The base's draft length and threshold moved to the nearest values the spaces allow."""
    b = ctx.base
    threshold = round(min(max(round(b.confidence_threshold / THRESHOLD_STEP) * THRESHOLD_STEP, 0.0), MAX_THRESHOLD), 2)
    return {"draft_length": min(max(b.draft_length, MIN_DRAFT_LENGTH), ctx.max_draft_length),
            "confidence_threshold": threshold}
