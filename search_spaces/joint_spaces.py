"""The joint spaces over drafter kinds: ``auto`` (every kind with everything that applies to it,
the default) and ``chain`` (a small enumerable grid); ``search_spaces.spaces`` registers them."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from search_spaces.errors import SpaceError
from search_spaces.kinds import DRAFT_MODEL, LAYER_SKIP, NONE, PROMPT_LOOKUP
from search_spaces.layer_plan import LayerPlan, easyspec_plan, uniform_skip_plan
from search_spaces.model_spaces import EasySpecSpace, LayerSkipSpace, LookupSpace, lp_groups
from search_spaces.space_base import (
    CHAIN_LENGTHS, CHAIN_THRESHOLDS, MAX_LP_SIZE, MIN_DRAFT_LENGTH, SearchSpace, SpaceContext, drafting_params,
    fit_widths, reference_drafting, suggest_length, suggest_threshold,
)
from search_spaces.strategy import PLAIN, Strategy, tree_node_bound

if TYPE_CHECKING:
    import optuna


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
            return (NONE, PROMPT_LOOKUP, DRAFT_MODEL)
        return (NONE, PROMPT_LOOKUP, LAYER_SKIP) if ctx.n_layers >= 3 else (NONE, PROMPT_LOOKUP)

    def define(self, trial: optuna.trial.BaseTrial, ctx: SpaceContext) -> Strategy:
        kind = trial.suggest_categorical("drafter", list(self.kinds(ctx)))
        return AUTO_BRANCHES[kind][0](trial, ctx)

    @staticmethod
    def _draft_model(trial: _Prefixed, ctx: SpaceContext) -> Strategy:
        assert ctx.draft_layers is not None
        lp_size = trial.suggest_int("lp_size", 1, MAX_LP_SIZE)
        first_size = trial.suggest_int("first_size", 1, lp_size) if lp_size > 1 else 1
        groups = lp_groups(ctx.draft_layers, lp_size, first_size)
        calibrate = trial.suggest_categorical("calibrate", [True, False]) if groups else True
        plan = LayerPlan(n_layers=ctx.draft_layers, groups=groups) if groups else None
        head = (trial.suggest_int("w1", 1, MAX_HEAD_WIDTHS[0]), trial.suggest_int("w2", 1, MAX_HEAD_WIDTHS[1]))
        length = suggest_length(trial, ctx)
        # the node budget (one verify width for the whole space): a shorter tree, then narrower heads
        def fits(h: tuple[int, int], n: int) -> bool:
            return tree_node_bound(fit_widths(h, n), None) <= ctx.max_draft_length

        while length > MIN_DRAFT_LENGTH and not fits(head, length):
            length -= 1
        while not fits(head, length):
            head = (head[0], head[1] - 1) if head[1] > 1 else (head[0] - 1, 1)
        widths = fit_widths(head, length)
        return replace(
            ctx.base, drafter=DRAFT_MODEL, draft_length=length, confidence_threshold=suggest_threshold(trial),
            tree_widths=None if all(w == 1 for w in widths) else widths, dynamic_widths=None,
            layer_plan=plan, calibrate=calibrate, lookup_first=trial.suggest_categorical("lookup", [False, True]),
        )

    def _params(self, strategy: Strategy, ctx: SpaceContext) -> dict[str, Any]:
        return {"drafter": strategy.drafter, **AUTO_BRANCHES[strategy.drafter][1](strategy, ctx)}

    @staticmethod
    def _draft_model_params(strategy: Strategy, ctx: SpaceContext) -> dict[str, Any]:
        if ctx.draft_layers is None:
            raise SpaceError("space 'auto' has no draft model in this context")
        groups = () if strategy.layer_plan is None else strategy.layer_plan.groups
        sizes = EasySpecSpace()._sizes(groups, replace(ctx, n_layers=ctx.draft_layers))
        widths = strategy.tree_widths or (1,) * strategy.draft_length
        head = (tuple(widths) + (1, 1))[:2]
        return _prefixed({
            **sizes, "calibrate": strategy.calibrate, "w1": head[0], "w2": head[1], **drafting_params(strategy),
            "lookup": strategy.lookup_first,
        }, "dm_")

    def _reference_params(self, ctx: SpaceContext) -> dict[str, Any]:
        return {"drafter": NONE}

    def seeds(self, ctx: SpaceContext) -> list[Strategy]:
        """Reference points, so every drafter kind is scored early: the draft model's chain at the
        base's length and threshold, a small tree (2 candidates at depth 1, depth 4) and
        EasySpec's default plan (or SWIFT's uniform skip without a draft model), and prompt
        lookup at the base's length."""
        kinds = self.kinds(ctx)
        length = min(max(ctx.base.draft_length, MIN_DRAFT_LENGTH), ctx.max_draft_length)
        threshold = reference_drafting(ctx)["confidence_threshold"]
        params = [{"drafter": PROMPT_LOOKUP, "lk_draft_length": length}]
        if DRAFT_MODEL in kinds:
            assert ctx.draft_layers is not None
            drafting = {"dm_w1": 1, "dm_w2": 1, "dm_draft_length": length, "dm_confidence_threshold": threshold,
                        "dm_lookup": False}
            easy = EasySpecSpace()._sizes(easyspec_plan(ctx.draft_layers, MAX_LP_SIZE).groups,
                                          replace(ctx, n_layers=ctx.draft_layers))
            params = [
                {"drafter": DRAFT_MODEL, "dm_lp_size": 1, **drafting},
                # a small tree: where the draft agrees less, a second candidate per step pays
                {"drafter": DRAFT_MODEL, "dm_lp_size": 1, **drafting, "dm_w1": 2,
                 "dm_draft_length": min(TREE_SEED_LENGTH, ctx.max_draft_length)},
                {"drafter": DRAFT_MODEL, **_prefixed(easy, "dm_"), "dm_calibrate": True, **drafting},
                # prompt lookup where the context repeats itself, the draft model elsewhere
                {"drafter": DRAFT_MODEL, "dm_lp_size": 1, **drafting, "dm_lookup": True},
            ] + params
        elif LAYER_SKIP in kinds:
            base = replace(ctx.base, drafter=LAYER_SKIP, layer_plan=uniform_skip_plan(ctx.n_layers, ctx.skip_ratio),
                           tree_widths=None, dynamic_widths=None)
            ref = LayerSkipSpace()._reference_params(replace(ctx, base=base))
            params = [{"drafter": LAYER_SKIP, **_prefixed(ref, "ls_")}] + params
        return [self._replay(p, ctx)[1] for p in params]

    def max_nodes(self, ctx: SpaceContext) -> int:
        """The most draft nodes of any strategy of the space: its verify width is this + 1."""
        return ctx.max_draft_length


_LOOKUP, _LAYER_SKIP = LookupSpace(), LayerSkipSpace()


def _auto_lookup(trial: optuna.trial.BaseTrial, ctx: SpaceContext) -> Strategy:
    return _LOOKUP.define(_Prefixed(trial, "lk_"), ctx)


def _auto_layer_skip(trial: optuna.trial.BaseTrial, ctx: SpaceContext) -> Strategy:
    placeholder = LayerPlan(n_layers=ctx.n_layers, skip_attn=(ctx.n_layers // 2,))  # define() replaces it
    base = replace(ctx.base, drafter=LAYER_SKIP, layer_plan=placeholder, calibrate=True,
                   tree_widths=None, dynamic_widths=None)
    return _LAYER_SKIP.define(_Prefixed(trial, "ls_"), replace(ctx, base=base))


Branch = tuple[Callable[[Any, SpaceContext], Strategy], Callable[[Strategy, SpaceContext], dict[str, Any]]]
# the `auto` space's branch per drafter kind: (its strategy from a trial, its prefixed parameters)
AUTO_BRANCHES: dict[str, Branch] = {
    NONE: (lambda trial, ctx: PLAIN, lambda strategy, ctx: {}),
    PROMPT_LOOKUP: (_auto_lookup, lambda strategy, ctx: _prefixed(_LOOKUP._params(strategy, ctx), "lk_")),
    LAYER_SKIP: (_auto_layer_skip, lambda strategy, ctx: _prefixed(_LAYER_SKIP._params(strategy, ctx), "ls_")),
    DRAFT_MODEL: (lambda trial, ctx: AutoSpace._draft_model(_Prefixed(trial, "dm_"), ctx),
                  AutoSpace._draft_model_params),
}



def _chain_lengths(ctx: SpaceContext) -> list[int]:
    return [n for n in CHAIN_LENGTHS if n <= ctx.max_draft_length] or [MIN_DRAFT_LENGTH]


class ChainSpace(SearchSpace):
    """A small grid (a few dozen points, enumerable): plain decoding, the draft model's chain or
    prompt lookup, at ``CHAIN_LENGTHS`` (capped by ``max_draft_length``) x ``CHAIN_THRESHOLDS``
    (the threshold only for the draft model). What the online tuner's pick is checked against by
    running every point (``points``)."""

    name, drafter, conditional = "chain", "chain", True

    def kinds(self, ctx: SpaceContext) -> tuple[str, ...]:
        return (NONE, DRAFT_MODEL, PROMPT_LOOKUP) if ctx.draft_layers else (NONE, PROMPT_LOOKUP)

    def define(self, trial: optuna.trial.BaseTrial, ctx: SpaceContext) -> Strategy:
        kind = trial.suggest_categorical("drafter", list(self.kinds(ctx)))
        if kind == NONE:
            return PLAIN
        lengths = _chain_lengths(ctx)
        if kind == PROMPT_LOOKUP:
            return replace(ctx.base, drafter=kind, draft_length=trial.suggest_categorical("lk_draft_length", lengths),
                           tree_widths=None, dynamic_widths=None, layer_plan=None)
        return replace(ctx.base, drafter=kind, draft_length=trial.suggest_categorical("dm_draft_length", lengths),
                       confidence_threshold=trial.suggest_categorical("dm_confidence_threshold", list(CHAIN_THRESHOLDS)),
                       tree_widths=None, dynamic_widths=None, layer_plan=None)

    def _params(self, strategy: Strategy, ctx: SpaceContext) -> dict[str, Any]:
        if strategy.drafter == NONE:
            return {"drafter": NONE}
        if strategy.drafter == PROMPT_LOOKUP:
            return {"drafter": strategy.drafter, "lk_draft_length": strategy.draft_length}
        return {"drafter": strategy.drafter, "dm_draft_length": strategy.draft_length,
                "dm_confidence_threshold": strategy.confidence_threshold}

    def _reference_params(self, ctx: SpaceContext) -> dict[str, Any]:
        return {"drafter": NONE}

    def seeds(self, ctx: SpaceContext) -> list[Strategy]:
        """Plain decoding (the reference), then one point per drafter kind at the grid length
        nearest the base's (threshold: the grid's nearest to the base's), so the online tuner
        sweeps both free families (the draft model's chain and prompt lookup) from its first
        window, as it does in ``auto``."""
        lengths = _chain_lengths(ctx)
        length = min(lengths, key=lambda n: (abs(n - ctx.base.draft_length), -n))
        params: list[dict[str, Any]] = [{"drafter": NONE}]
        if DRAFT_MODEL in self.kinds(ctx):
            threshold = min(CHAIN_THRESHOLDS, key=lambda t: abs(t - ctx.base.confidence_threshold))
            params.append({"drafter": DRAFT_MODEL, "dm_draft_length": length, "dm_confidence_threshold": threshold})
        params.append({"drafter": PROMPT_LOOKUP, "lk_draft_length": length})
        return [self._replay(p, ctx)[1] for p in params]

    def points(self, ctx: SpaceContext) -> list[Strategy]:
        """Every strategy of the space."""
        lengths = _chain_lengths(ctx)
        params = [{"drafter": NONE}]
        if DRAFT_MODEL in self.kinds(ctx):
            params += [{"drafter": DRAFT_MODEL, "dm_draft_length": n, "dm_confidence_threshold": t}
                       for n in lengths for t in CHAIN_THRESHOLDS]
        params += [{"drafter": PROMPT_LOOKUP, "lk_draft_length": n} for n in lengths]
        return [self._replay(p, ctx)[1] for p in params]
