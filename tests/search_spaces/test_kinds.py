"""The drafter-kind registry: one entry per kind, parts attached once by the layers above, and
strategies validated from the kinds' traits (with the messages they always had)."""
from __future__ import annotations

import pytest

from search_spaces.errors import StrategyError
from search_spaces.kinds import (
    BUILT_IN, DRAFT_MODEL, KINDS, LAYER_SKIP, NONE, PARTS, PROMPT_LOOKUP, DrafterKind, attach, kind_of, register,
    unregister,
)
from search_spaces.layer_plan import LayerPlan
from search_spaces.strategy import Strategy


def test_the_built_in_kinds_keep_their_stored_names():
    assert BUILT_IN == ("none", "draft-model", "layer-skip", "prompt-lookup") == (NONE, DRAFT_MODEL, LAYER_SKIP,
                                                                                    PROMPT_LOOKUP)
    assert tuple(KINDS)[:4] == BUILT_IN


def test_the_layers_above_attach_every_part_of_every_built_in_kind():
    """Importing the modules that attach them (the runtime's factories, the tuner's scorers)
    completes every entry; a part asked of a kind that lacks it is an error naming it."""
    import autotune.tuning.scoring  # noqa: F401
    import runtime.pipeline  # noqa: F401

    assert all(set(PARTS) <= set(KINDS[name].parts) for name in BUILT_IN)
    with pytest.raises(StrategyError, match="has no 'score' part attached"):
        DrafterKind("lonely").part("score")


def test_registering_a_kind_makes_it_a_strategy_and_is_undone():
    kind = register(DrafterKind("toy"), build=lambda *args: None)
    try:
        assert kind_of("toy") is kind and "build" in kind.parts
        assert Strategy(drafter="toy").speculates
        with pytest.raises(StrategyError, match="registered already"):
            register(DrafterKind("toy"))
        with pytest.raises(StrategyError, match="attached already"):
            attach("toy", build=lambda *args: None)
        with pytest.raises(StrategyError, match="unknown part 'price'"):
            attach("toy", price=lambda *args: None)
        with pytest.raises(StrategyError, match="layer_plan is only used by drafters draft-model and layer-skip"):
            Strategy(drafter="toy", layer_plan=LayerPlan(n_layers=3, skip_mlp=(1,)))
    finally:
        unregister("toy")
    with pytest.raises(StrategyError, match="drafter='toy' is not allowed; choose one of none, draft-model"):
        Strategy(drafter="toy")
    with pytest.raises(StrategyError, match="built in"):
        unregister(PROMPT_LOOKUP)


@pytest.mark.parametrize("fields, message", [
    (dict(name=""), "non-empty name"),
    (dict(name="x", layer_plan="sometimes"), "layer_plan='sometimes'"),
    (dict(name="x", copies_first=True), "only a kind drafting with a model"),
    (dict(name="x", speculates=1), "speculates=1 must be true or false"),
])
def test_bad_kinds_are_refused(fields, message):
    with pytest.raises(StrategyError, match=message):
        DrafterKind(**fields)


def test_strategy_messages_read_as_before():
    """The traits give the messages the literal checks gave."""
    with pytest.raises(StrategyError, match="lookup_first is only used by drafter draft-model, not 'prompt-lookup'"):
        Strategy(drafter=PROMPT_LOOKUP, lookup_first=True)
    with pytest.raises(StrategyError, match="drafter 'layer-skip' needs a plan that skips at least one sub-layer"):
        Strategy(drafter=LAYER_SKIP)
    with pytest.raises(StrategyError, match="layer_plan is only used by drafters draft-model and layer-skip, not 'none'"):
        Strategy(drafter=NONE, layer_plan=LayerPlan(n_layers=3, skip_mlp=(1,)))
    assert not Strategy(drafter=NONE).speculates and Strategy(drafter=PROMPT_LOOKUP).speculates
