import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from search_spaces import PLAIN, Strategy, StrategyError


@given(
    drafter=st.sampled_from(["none", "draft-model"]),
    k=st.integers(1, 64),
    precision=st.sampled_from(["auto", "float32", "bfloat16", "int8"]),
    vocab=st.one_of(st.none(), st.integers(1, 200_000)),
    threshold=st.floats(0.0, 1.0),
)
def test_json_round_trip(drafter, k, precision, vocab, threshold):
    s = Strategy(drafter=drafter, draft_length=k, draft_precision=precision, draft_vocab=vocab,
                 confidence_threshold=threshold)
    assert Strategy.from_json(s.to_json()) == s


@pytest.mark.parametrize(
    "field,value",
    [("draft_length", 0), ("draft_length", 65), ("draft_length", 2.5), ("drafter", "magic"),
     ("draft_precision", "int3"), ("draft_vocab", 0), ("confidence_threshold", 1.5), ("schema_version", 99)],
)
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(StrategyError, match=field):
        Strategy(**{field: value})


def test_unknown_field_and_bad_json():
    with pytest.raises(StrategyError, match="unknown strategy field"):
        Strategy.from_dict({"draft_lenght": 3})
    with pytest.raises(StrategyError, match="not valid JSON"):
        Strategy.from_json("{draft_length: 3")
    with pytest.raises(StrategyError, match="JSON object"):
        Strategy.from_json(json.dumps([1, 2]))


def test_plain_does_not_speculate():
    assert not PLAIN.speculates and Strategy().speculates
