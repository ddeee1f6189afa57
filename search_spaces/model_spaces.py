"""The named single-kind spaces: SWIFT layer skipping (``layer-skip``, ``layer-skip-free``), a
draft model with EasySpec groups (``easyspec``) or a tree menu (``draft``), and prompt lookup
(``lookup``); ``search_spaces.spaces`` describes them and registers them."""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from search_spaces.errors import SpaceError
from search_spaces.kinds import DRAFT_MODEL, LAYER_SKIP, PROMPT_LOOKUP
from search_spaces.layer_plan import LayerPlan, easyspec_plan, uniform_skip_plan
from search_spaces.space_base import (
    MAX_LP_SIZE, TREE_SHAPES, SearchSpace, SpaceContext, drafting, drafting_params, fit_widths, reference_drafting,
    suggest_length,
)
from search_spaces.strategy import Strategy

if TYPE_CHECKING:
    import optuna


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


class LayerSkipSpace(SearchSpace):
    """SWIFT self-speculation at a fixed skip ratio.

    ``s_attn_{i}`` / ``s_mlp_{i}`` (float 0..1, layers i = 1..n-2): a score per sub-layer; the
    ``skip_count`` highest scores are skipped (ties: lower layer first, attention before MLP).
    Continuous, so GPSampler applies. Plus ``draft_length`` and ``confidence_threshold``.
    """

    name, drafter = "layer-skip", LAYER_SKIP

    @staticmethod
    def skip_count(ctx: SpaceContext) -> int:
        """``round(r * 2 * n_layers)`` sub-layers, clipped to 1..the skippable ones."""
        return max(1, min(len(_sublayers(ctx)), round(ctx.skip_ratio * 2 * ctx.n_layers)))

    def define(self, trial: optuna.trial.BaseTrial, ctx: SpaceContext) -> Strategy:
        subs = _sublayers(ctx)
        scores = [trial.suggest_float(f"s_{kind}_{i}", 0.0, 1.0) for i, kind in subs]
        top = sorted(range(len(subs)), key=lambda j: (-scores[j], j))[: self.skip_count(ctx)]
        return drafting(trial, ctx, drafter=self.drafter, layer_plan=_skip_plan(ctx, [subs[j] for j in top]))

    def _params(self, strategy: Strategy, ctx: SpaceContext) -> dict[str, Any]:
        return {**self._scores(strategy.layer_plan, ctx), **drafting_params(strategy)}

    def _reference_params(self, ctx: SpaceContext) -> dict[str, Any]:
        # SWIFT's uniform whole-layer skip; where its 2*round(r*n) sub-layers differ from the fixed
        # count, the score ranking above drops/adds one sub-layer
        return {**self._scores(uniform_skip_plan(ctx.n_layers, ctx.skip_ratio), ctx), **reference_drafting(ctx)}

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

    name, drafter = "layer-skip-free", LAYER_SKIP

    def define(self, trial: optuna.trial.BaseTrial, ctx: SpaceContext) -> Strategy:
        skipped = [(i, kind) for i, kind in _sublayers(ctx) if trial.suggest_int(f"skip_{kind}_{i}", 0, 1)]
        plan = _skip_plan(ctx, skipped or [(ctx.n_layers // 2, "attn")])
        return drafting(trial, ctx, drafter=self.drafter, layer_plan=plan)

    def _params(self, strategy: Strategy, ctx: SpaceContext) -> dict[str, Any]:
        return {**self._flags(strategy.layer_plan, ctx), **drafting_params(strategy)}

    def _reference_params(self, ctx: SpaceContext) -> dict[str, Any]:
        return {**self._flags(uniform_skip_plan(ctx.n_layers, ctx.skip_ratio), ctx), **reference_drafting(ctx)}

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

    name, drafter, conditional = "easyspec", DRAFT_MODEL, True

    def define(self, trial: optuna.trial.BaseTrial, ctx: SpaceContext) -> Strategy:
        lp_size = trial.suggest_int("lp_size", 1, MAX_LP_SIZE)
        first_size = trial.suggest_int("first_size", 1, lp_size) if lp_size > 1 else 1
        groups = lp_groups(ctx.n_layers, lp_size, first_size)
        if not groups:
            return drafting(trial, ctx, drafter=self.drafter, layer_plan=None)
        calibrate = trial.suggest_categorical("calibrate", [True, False])
        plan = LayerPlan(n_layers=ctx.n_layers, groups=groups)
        return drafting(trial, ctx, drafter=self.drafter, layer_plan=plan, calibrate=calibrate)

    def _params(self, strategy: Strategy, ctx: SpaceContext) -> dict[str, Any]:
        groups = () if strategy.layer_plan is None else strategy.layer_plan.groups
        return {**self._sizes(groups, ctx), "calibrate": strategy.calibrate, **drafting_params(strategy)}

    def _reference_params(self, ctx: SpaceContext) -> dict[str, Any]:
        groups = easyspec_plan(ctx.n_layers, MAX_LP_SIZE).groups  # EasySpec's default N=4, with calibration
        return {**self._sizes(groups, ctx), "calibrate": True, **reference_drafting(ctx)}

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

    name, drafter = "draft", DRAFT_MODEL

    def define(self, trial: optuna.trial.BaseTrial, ctx: SpaceContext) -> Strategy:
        tree = TREE_SHAPES[trial.suggest_categorical("tree", list(TREE_SHAPES))]
        return drafting(trial, ctx, tree=tree, drafter=self.drafter, layer_plan=None)

    def _params(self, strategy: Strategy, ctx: SpaceContext) -> dict[str, Any]:
        tree = _tree_name(strategy.tree_widths, strategy.dynamic_widths, strategy.draft_length)
        if tree is None:
            raise SpaceError(
                f"tree_widths={strategy.tree_widths} / dynamic_widths={strategy.dynamic_widths} is not in the "
                f"tree menu of space '{self.name}' ({', '.join(TREE_SHAPES)})"
            )
        return {"tree": tree, **drafting_params(strategy)}

    def _reference_params(self, ctx: SpaceContext) -> dict[str, Any]:
        drafting, b = reference_drafting(ctx), ctx.base
        length = drafting["draft_length"]  # the base's tree at this length if the menu has it, else a chain
        return {"tree": _tree_name(fit_widths(b.tree_widths, length), b.dynamic_widths, length) or "chain", **drafting}


def _tree_name(widths: tuple[int, ...] | None, dynamic: Any, length: int) -> str | None:
    """The menu name of this tree shape at ``length`` depths, if any."""
    for name, (head, menu_dynamic) in TREE_SHAPES.items():
        if (fit_widths(head, length), menu_dynamic) == (widths, dynamic):
            return name
    return None


class LookupSpace(SearchSpace):
    """Prompt lookup (copy the continuation of the latest matching n-gram): ``draft_length`` only."""

    name, drafter = "lookup", PROMPT_LOOKUP

    def define(self, trial: optuna.trial.BaseTrial, ctx: SpaceContext) -> Strategy:
        return replace(ctx.base, drafter=self.drafter, draft_length=suggest_length(trial, ctx),
                       tree_widths=None, dynamic_widths=None, layer_plan=None)

    def _params(self, strategy: Strategy, ctx: SpaceContext) -> dict[str, Any]:
        return {"draft_length": strategy.draft_length}

    def _reference_params(self, ctx: SpaceContext) -> dict[str, Any]:
        return {"draft_length": reference_drafting(ctx)["draft_length"]}
