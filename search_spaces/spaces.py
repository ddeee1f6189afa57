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
from search_spaces.errors import SpaceError
from search_spaces.joint_spaces import AutoSpace, ChainSpace
from search_spaces.model_spaces import (
    DraftSpace, EasySpecSpace, LayerSkipFreeSpace, LayerSkipSpace, LookupSpace, lp_groups,
)
from search_spaces.space_base import (
    CHAIN_LENGTHS, CHAIN_THRESHOLDS, MAX_LP_SIZE, MAX_SPACE_DRAFT_LENGTH, MAX_THRESHOLD, MIN_DRAFT_LENGTH,
    SWEEP_HEADS, SWEEP_LENGTHS, SWEEP_THRESHOLDS, THRESHOLD_STEP, TREE_SHAPES, SearchSpace, SpaceContext,
)
from search_spaces.strategy import Strategy

__all__ = [
    "CHAIN_LENGTHS", "CHAIN_THRESHOLDS", "MAX_LP_SIZE", "MAX_SPACE_DRAFT_LENGTH", "MAX_THRESHOLD", "MIN_DRAFT_LENGTH",
    "SPACES", "SWEEP_HEADS", "SWEEP_LENGTHS", "SWEEP_THRESHOLDS", "THRESHOLD_STEP", "TREE_SHAPES", "AutoSpace",
    "ChainSpace", "DraftSpace", "EasySpecSpace", "LayerSkipFreeSpace", "LayerSkipSpace", "LookupSpace", "SearchSpace",
    "SpaceContext", "get_space", "lp_groups", "uniform_strategy",
]

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
