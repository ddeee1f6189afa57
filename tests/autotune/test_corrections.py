"""The one correction scheme (``autotune.tuning.corrections``) the tuner's race and the request
controller share: a per-strategy ratio of averages, its kind's geometric mean for a strategy not
measured yet, a bounded range, and evidence that decays past a memory."""
from __future__ import annotations

import math

import pytest

from autotune.tuning.corrections import CORRECTION_RANGE, Corrections
from search_spaces.strategy import PLAIN, Strategy

CHAIN4 = Strategy(drafter="draft-model", draft_length=4)
CHAIN8 = Strategy(drafter="draft-model", draft_length=8)
TREE = Strategy(drafter="draft-model", draft_length=3, tree_widths=(2, 1, 1))
LOOKUP = Strategy(drafter="prompt-lookup", draft_length=8)


def test_a_factor_is_measured_speed_over_the_mean_prediction():
    c = Corrections()
    assert c.factor(CHAIN4) == 1.0  # nothing known
    c.observe(CHAIN4, [10.0, 30.0], tokens=100, seconds=10.0)  # 10 tok/s measured, 20 predicted on average
    assert c.factor(CHAIN4) == pytest.approx(0.5)
    c.observe(CHAIN4, 10.0, tokens=100, seconds=5.0)  # a ratio of averages, not an average of ratios
    assert c.factor(CHAIN4) == pytest.approx((200 / 15.0) / (50.0 / 3))


def test_an_unmeasured_strategy_takes_its_kinds_geometric_mean():
    c = Corrections()
    c.observe(CHAIN4, 10.0, tokens=50, seconds=10.0)  # 0.5
    c.observe(CHAIN8, 10.0, tokens=200, seconds=10.0)  # 2.0
    assert c.factor(TREE) == pytest.approx(1.0)  # sqrt(0.5 * 2)
    assert c.factor(LOOKUP) == 1.0  # another kind learns nothing from these
    assert c.factor(CHAIN4) == pytest.approx(0.5)  # its own evidence first
    assert set(c.evidence) == {CHAIN4, CHAIN8}


def test_one_odd_stretch_cannot_price_a_strategy_out():
    c = Corrections()
    c.observe(LOOKUP, 1.0, tokens=1000, seconds=1.0)  # 1000x the prediction
    assert c.factor(LOOKUP) == CORRECTION_RANGE[1]
    c.observe(CHAIN4, 1000.0, tokens=1, seconds=1.0)
    assert c.factor(CHAIN4) == CORRECTION_RANGE[0]


def test_plain_decoding_and_empty_stretches_keep_no_factor():
    c = Corrections()
    c.observe(PLAIN, 10.0, tokens=100, seconds=1.0)
    c.observe(CHAIN4, 10.0, tokens=0, seconds=1.0)
    c.observe(CHAIN4, [], tokens=10, seconds=1.0)
    assert c.evidence == {} and c.factor(PLAIN) == 1.0


def test_evidence_decays_past_the_memory_so_a_changed_machine_is_followed():
    """Power check: without the memory, the old evidence (4096 tokens at 2x) holds the factor near
    1 after the machine slowed to 0.5x; with it, the new stretches weigh as they arrive."""
    remembering, forever = Corrections(memory_tokens=512), Corrections(memory_tokens=10**9)
    for c in (remembering, forever):
        for _ in range(32):
            c.observe(CHAIN4, 10.0, tokens=128, seconds=6.4)  # 20 tok/s: 2x the prediction
        for _ in range(16):
            c.observe(CHAIN4, 10.0, tokens=128, seconds=25.6)  # 5 tok/s: 0.5x
    assert remembering.factor(CHAIN4) < 0.6
    assert forever.factor(CHAIN4) > 0.9  # 6144 tokens in 614 s: the old machine still speaks for half
    assert remembering.evidence[CHAIN4].tokens == pytest.approx(512)


def test_a_memory_must_hold_a_token():
    with pytest.raises(ValueError, match="memory_tokens"):
        Corrections(memory_tokens=0)
    assert math.isclose(Corrections().factor(TREE), 1.0)


def test_a_kind_of_traffic_prices_with_its_own_evidence_before_the_servers():
    """Lookup measured well on code and at a loss on chat: the chat route's next request prices
    lookup at chat's factor, a kind with no evidence of its own at the server's (both kinds' evidence
    pooled) capped at 1, and what a kind measures teaches the server too. Power check: the one shared factor
    alone prices chat's lookup near par, where a window predicting 1.5x plain would switch to it."""
    from autotune.tuning.corrections import KindCorrections

    shared = Corrections()
    code, chat, new = (KindCorrections(shared) for _ in range(3))
    code.observe(LOOKUP, 20.0, tokens=400, seconds=10.0)  # 40 tok/s measured, 20 predicted: 2.0
    chat.observe(LOOKUP, 30.0, tokens=30, seconds=3.0)  # 10 tok/s measured, 30 predicted: 1/3
    assert code.factor(LOOKUP) == pytest.approx(2.0) and chat.factor(LOOKUP) == pytest.approx(1 / 3)
    assert shared.factor(LOOKUP) > 1.0 and new.factor(LOOKUP) == 1.0  # not code's long repeats
    assert shared.evidence[LOOKUP].tokens == 430  # both kinds taught the server
    shorter = Strategy(drafter="prompt-lookup", draft_length=4)
    assert chat.factor(shorter) == pytest.approx(1 / 3)  # its own drafter kind before the server's
    assert chat.factor(CHAIN4) == shared.factor(CHAIN4) == 1.0 and chat.factor(PLAIN) == 1.0
    code.observe(CHAIN4, 20.0, tokens=100, seconds=10.0)  # the draft chain measured at half its price
    assert new.factor(CHAIN4) == pytest.approx(0.5)  # the server's costs below prediction do carry over
    predicted, plain_tps = 15.0, 10.0  # one window's lookup prediction on chat, and plain's speed
    assert predicted * chat.factor(LOOKUP) < plain_tps  # chat's own evidence: stays plain
    assert predicted * shared.factor(LOOKUP) > plain_tps * 1.05  # the pooled factor: would switch and lose
    chat.model_s = 0.5
    assert shared.model_s == 0.5 and code.model_s == 0.5  # what scoring a model costs is the server's
