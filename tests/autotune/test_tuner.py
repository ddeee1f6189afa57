"""Matchness, the objective and the online tuner on tiny random-weight models (fast tier)."""
from __future__ import annotations

from dataclasses import replace

import optuna
import pytest
import torch

from autotune.tuning.corrections import CORRECTION_RANGE
from autotune.tuning.cost_model import FixedCostModel, MeasuredCostModel
from autotune.tuning.matchness import TOP_K, LookupMatch, Match, matchness, score_logits
from autotune.tuning.matchness import lookup_match
from autotune.tuning.objective import (
    lookup_rounds, lookup_walk, predict, predict_lookup, predict_lookup_first, predict_lookup_text, replay,
)
from autotune.tuning.tuner import Kept, OnlineTuner, TunerSettings
from runtime.decoding import Decoder, GenerationConfig
from runtime.drafters import ModelDrafter, SelfDrafter, tree_shape
from runtime.errors import RuntimeUserError
from runtime.lookup import PromptLookupDrafter
from runtime.sampling import SamplingParams
from runtime.stats import DecodeStats
from runtime.testing import tiny_model
from runtime.transformer import CausalLM
from search_spaces.errors import SpaceError
from search_spaces.layer_plan import LayerPlan, easyspec_plan, uniform_skip_plan
from search_spaces.spaces import SpaceContext, get_space
from search_spaces.strategy import PLAIN, Strategy

N_LAYERS = 8
PROMPT = [5, 17, 3, 88, 42, 7, 9, 61, 12, 30]
PLANS = {
    "none": None,
    "skip": uniform_skip_plan(N_LAYERS, 0.3),
    "groups": easyspec_plan(N_LAYERS, 3),
    "mixed": LayerPlan(n_layers=N_LAYERS, groups=((1, 2),), skip_attn=(4,), skip_mlp=(5, 6)),
}


@pytest.fixture(scope="module")
def target() -> CausalLM:
    return CausalLM(tiny_model("llama", 40, layers=N_LAYERS))


@pytest.fixture(scope="module")
def draft() -> CausalLM:
    model = tiny_model("llama", 40, layers=N_LAYERS)  # the target's weights plus noise
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05 * p.std())
    return CausalLM(model)


def plain_tokens(lm: CausalLM, n: int) -> list[int]:
    return PROMPT + Decoder(lm).generate(PROMPT, GenerationConfig(max_new_tokens=n)).tokens


def prefilled(lm: CausalLM, tokens: list[int], upto: int):
    cache = lm.new_cache(len(tokens) + 4)
    with torch.inference_mode():
        lm(torch.tensor(tokens[:upto]), cache)
    return cache


# ---------------------------------------------------------------------------------- matchness
@pytest.mark.parametrize("plan", list(PLANS), ids=list(PLANS))
def test_matchness_equals_a_token_by_token_reference(target, plan):
    tokens = plain_tokens(target, 30)
    window = 16
    start = len(tokens) - window - 1
    cache = prefilled(target, tokens, len(tokens) - 1)  # what a decoder holds before a round
    keys, values, length = cache.all_keys.clone(), cache.all_values.clone(), cache.length
    got = matchness(target, cache, PLANS[plan], tokens, window)
    # the cache is left exactly as it was
    assert cache.length == length
    assert torch.equal(cache.all_keys, keys) and torch.equal(cache.all_values, values)
    # reference: exact prefix, then the window's inputs one token per forward under the plan
    ref_cache = prefilled(target, tokens, start)
    rows = []
    with torch.inference_mode():
        for pos in range(start, len(tokens) - 1):
            rows.append(target(torch.tensor([tokens[pos]]), ref_cache, plan=PLANS[plan]).float()[0])
    ref = score_logits(torch.stack(rows), torch.tensor(tokens[len(tokens) - window:]))
    assert torch.equal(got.hits, ref.hits)
    assert torch.allclose(got.confidence, ref.confidence, atol=1e-5)
    if plan == "none":  # the target scoring itself on its own greedy output matches every token
        assert got.rate == 1.0


def test_matchness_rates_and_topk():
    logits = torch.tensor([[5.0, 1.0, 0.0], [0.0, 5.0, 4.0], [0.0, 1.0, 5.0], [3.0, 2.0, 1.0]])
    m = score_logits(logits, torch.tensor([0, 2, 0, 1]))
    assert m.rate == 0.25  # only row 0's argmax is right
    assert m.topk_rate(2) == 0.75  # rows 0, 1 (second best) and 3
    assert m.topk_rate(3) == 1.0 and m.hits.shape == (4, len(TOP_K))


def test_matchness_needs_a_cached_prefix(target):
    tokens = plain_tokens(target, 20)
    cache = prefilled(target, tokens, 3)
    with pytest.raises(ValueError, match="cannot score a window"):
        matchness(target, cache, None, tokens, 16)


# ---------------------------------------------------------------------------------- objective
def synthetic(hits_top1: list[bool], conf: list[float]) -> Match:
    hits = torch.tensor([[h] * len(TOP_K) for h in hits_top1])
    return Match(hits, torch.tensor(conf))


def test_replay_counts_the_accepted_prefix_and_early_stops():
    all_hit = synthetic([True] * 12, [0.99] * 12)
    accepted, drafted, forwards = replay(Strategy(draft_length=4, confidence_threshold=0.0), all_hit)
    assert (accepted, drafted, forwards) == (4.0, 4.0, 3.0)
    # every third token missed: from each start the chain stops at the next miss
    pattern = synthetic([i % 3 != 2 for i in range(12)], [0.99] * 12)
    accepted, _, _ = replay(Strategy(draft_length=4, confidence_threshold=0.0), pattern)
    assert 0.0 < accepted < 2.0
    # low confidence after the first draft: only one token drafted per round
    unsure = synthetic([True] * 12, [0.1] * 12)
    accepted, drafted, forwards = replay(Strategy(draft_length=4, confidence_threshold=0.5), unsure)
    assert (accepted, drafted, forwards) == (1.0, 1.0, 1.0)


def test_prepare_times_the_plain_step_again_last_and_keeps_the_faster(target, draft):
    """The first forwards after a load run slow (the plain step 105 ms at start-up against 81 ms
    warm on a gguf 1.5B): ``prepare`` times the plain step again after every other forward and
    keeps the faster, so a server's start-up judgements do not see plain decoding slower than it is."""
    cost = MeasuredCostModel(draft=draft, target=target, verify_width=5, context=32, repeats=1)
    plain_timings = iter([2.0, 2.0, 1.0, 1.0])  # each timing the faster of two: first pass, then last

    def timed(lm, rows, plan, best_of=1, every_logit=False):
        return min(next(plain_timings) for _ in range(best_of)) if lm is target and rows == 1 else 5.0

    cost._forward_s = timed
    cost.prepare()
    assert cost.plain_step_s() == 1.0
    cost.observe_plain(3.0)  # decoded plain rounds price it from then on: a later prepare keeps them
    seen = cost.plain_step_s()
    cost.prepare()
    assert cost.plain_step_s() == seen


def test_a_second_cost_model_of_the_same_target_adopts_its_timings(target, draft):
    """A server times one cost model per drafting model; the target's forwards cost the same
    whichever model drafts, so a second cost model of the same target (width, padding, context)
    adopts the first one's target timings and times only its own draft. Another width times afresh."""
    calls: list[tuple[str, int]] = []

    def model(width=5):
        cost = MeasuredCostModel(draft=draft, target=target, verify_width=width, context=32, repeats=1,
                                 padded=False)

        def timed(lm, rows, plan, best_of=1, every_logit=False):
            calls.append(("target" if lm is target else "draft", rows))
            return 1.0 + rows
        cost._forward_s = timed
        return cost

    first = model()
    first.prepare()
    target_calls = [c for c in calls if c[0] == "target"]
    assert {rows for _, rows in target_calls} == {1, 2, 3, 4, 5}  # the plain step and every verify row count
    second, calls[:] = model(), []
    assert second.adopt_target(first) and not first.adopt_target(first)
    second.prepare()
    assert calls and all(lm == "draft" for lm, _ in calls), calls  # its draft's forwards only
    assert [second.verify_s(r) for r in (1, 2, 3, 5)] == [first.verify_s(r) for r in (1, 2, 3, 5)]
    calls[:] = []
    second.prepare()  # prepared: a second call times nothing
    assert calls == []
    wider = model(width=6)
    assert not wider.adopt_target(first)  # another verify width: its own timings
    wider.prepare()
    assert {rows for lm, rows in calls if lm == "target"} >= {1, 2, 3, 4, 5, 6}


def test_predict_is_theorem_3_8_shaped():
    cost = FixedCostModel(draft_full_s=1.0, verify_const_s=3.0)
    p = predict(Strategy(draft_length=4, confidence_threshold=0.0), synthetic([True] * 12, [1.0] * 12), cost)
    assert p.tokens_per_round == 5.0 and p.seconds_per_round == 4 * 1.0 + 3.0
    assert p.tokens_per_s == pytest.approx(5 / 7)
    miss = predict(Strategy(draft_length=4, confidence_threshold=0.0), synthetic([False] * 12, [1.0] * 12), cost)
    assert miss.tokens_per_round == 1.0 and miss.tokens_per_s < 1 / cost.plain_step_s()


def test_measured_cost_model_times_real_forwards(target, draft):
    cost = MeasuredCostModel(draft=draft, target=target, verify_width=5, context=32, repeats=1)
    full, skipping = cost.draft_forward_s(None), cost.draft_forward_s(uniform_skip_plan(N_LAYERS, 0.5))
    assert full > 0 and 0 < skipping <= full
    assert cost.verify_s() > 0 and cost.plain_step_s() > 0 and cost.calibration_s > 0
    # one row of catch-up: the cheaper of the one-row and the wide timing (noise can put the wide one below)
    assert cost.catch_up_s(5) >= cost.catch_up_s(1) and 0 < cost.catch_up_s(1) <= full
    before = cost.draft_forward_s(None)
    cost.observe_draft(predicted_s=before, measured_s=2 * before)
    assert cost.draft_forward_s(None) > before  # refreshed from a slower measured round
    verify = cost.verify_s()
    cost.observe_verify(3 * verify)
    assert cost.verify_s() > verify
    plain = cost.plain_step_s()
    cost.observe_plain(plain / 5)
    cost.observe_plain(plain / 5)
    assert cost.plain_step_s() == pytest.approx(plain / 5)  # plain rounds seen while decoding move the bar too
    fresh = MeasuredCostModel(draft=draft, target=target, verify_width=5, context=32, repeats=1)
    fresh.observe_verify(0.25)  # seen while decoding: no timing run needed
    assert fresh.verify_s() == 0.25 and fresh.calibration_s == 0.0


def test_measured_cost_model_times_only_what_a_plan_needs(target, draft):
    """The calibration is part of the tuning share: a draft's all-layer plan needs one timed
    forward, and only a plan that skips sub-layers pays for the attention / MLP split."""
    cost = MeasuredCostModel(draft=draft, target=target, verify_width=5, context=32, repeats=1)
    timed: list[tuple[int, object]] = []
    real = cost._forward_s
    cost._forward_s = lambda lm, rows, plan, **kw: timed.append((rows, plan)) or real(lm, rows, plan, **kw)
    full = cost.draft_forward_s(None)
    assert cost.draft_forward_s(None) == full and timed == [(1, None)]  # one timed forward, for every use
    assert 0 < cost.catch_up_s(1) <= full and timed[1:] == [(5, None)]  # + the catch-up's width
    cost.draft_forward_s(uniform_skip_plan(N_LAYERS, 0.5))
    assert len(timed) == 4 and all(rows == 1 and (p.skip_attn or p.skip_mlp) for rows, p in timed[2:])


def test_a_draft_forward_is_priced_warm(target, draft, monkeypatch):
    """A study times the draft right after loading it, with no warm-up: its first forward pays
    one-time costs. The draft step and the catch-up's wide forward are each the faster of two
    timings, so a cold first call does not price every catch-up as one row (a 750-token catch-up
    then looked affordable, and spent a GSM8K study's whole tuning allowance eight times over).
    Power check: the first timing of each is 3x the second."""
    seen: dict[int, int] = {}

    def forward_s(self, lm, rows, plan, best_of=1, every_logit=False):
        times = []
        for _ in range(best_of):
            seen[rows] = seen.get(rows, 0) + 1
            times.append((0.6 if seen[rows] == 1 else 0.2) * (1 + 0.1 * (rows - 1)))
        return min(times)

    monkeypatch.setattr(MeasuredCostModel, "_forward_s", forward_s)
    cost = MeasuredCostModel(draft=draft, target=target, verify_width=5, context=32, repeats=1, warm=False)
    assert cost.draft_forward_s(None) == pytest.approx(0.2)
    assert cost.catch_up_s(1) == pytest.approx(0.2) and cost.catch_up_s(5) == pytest.approx(0.28)
    assert cost.catch_up_s(750) == pytest.approx(0.2 + 749 * 0.02)


def test_prepare_times_every_row_count_up_front(target, draft):
    """``prepare`` (a server's start-up) times all a controller may price: afterwards pricing any
    verify width runs no forward (inside a request it would count as the request's scoring time)."""
    cost = MeasuredCostModel(draft=draft, target=target, verify_width=6, context=32, repeats=1, padded=False)
    cost.prepare()
    timed: list[int] = []
    real = cost._forward_s
    cost._forward_s = lambda lm, rows, plan, **kw: timed.append(rows) or real(lm, rows, plan, **kw)
    for rows in range(1, 7):
        assert cost.verify_s(rows) > 0
    cost.plain_step_s(), cost.draft_forward_s(None), cost.catch_up_s(3)
    assert timed == []
    lazy = MeasuredCostModel(draft=draft, target=target, verify_width=6, context=32, repeats=1, padded=False)
    lazy.verify_s(), lazy.plain_step_s()
    real = lazy._forward_s
    lazy._forward_s = lambda lm, rows, plan, **kw: timed.append(rows) or real(lm, rows, plan, **kw)
    lazy.verify_s(3)
    assert timed == [3]  # power: without prepare a new row count is timed when first priced


def test_kept_timings_of_gguf_models_are_keyed_by_the_kernels_build(target, draft, monkeypatch):
    """Timings kept for a gguf model name the extension's build: another build (new kernels, new
    flags) times again instead of pricing with the old build's figures; float models do not."""
    import runtime.kernels

    cost = MeasuredCostModel(draft=draft, target=target, verify_width=6, context=32, padded=False)
    assert "kernels" not in cost.shape
    quantised = CausalLM(tiny_model("llama", 40, layers=N_LAYERS))
    quantised.use_linear_backend("gguf")
    gguf_cost = MeasuredCostModel(draft=draft, target=quantised, verify_width=6, context=32, padded=False)
    shape = gguf_cost.shape
    assert f"kernels {runtime.kernels.extension_key()}" in shape
    monkeypatch.setattr(runtime.kernels, "extension_key", lambda: "another-build")
    assert gguf_cost.shape != shape


def test_kept_timings_restore_a_cost_model_without_timing_a_forward(target, draft):
    """``timings`` -> the store -> ``restore``: a later study prices the same as the model that
    timed them and runs no forward (its one-time cost is paid once per models and machine); kept
    at another verify width or padding they are not taken. Power check: unrestored, pricing times."""
    import json

    cost = MeasuredCostModel(draft=draft, target=target, verify_width=6, context=32, repeats=1, padded=False)
    cost.prepare(fit_skips=True)
    cost.observe_plain(cost.plain_step_s() * 1.5)
    kept = json.loads(json.dumps(cost.timings()))  # what the store holds
    again = MeasuredCostModel(draft=draft, target=target, verify_width=6, context=32, repeats=1, padded=False)
    assert again.restore(kept)
    timed: list[int] = []
    real = again._forward_s
    again._forward_s = lambda lm, rows, plan, **kw: timed.append(rows) or real(lm, rows, plan, **kw)
    plan = uniform_skip_plan(N_LAYERS, 0.5)
    for rows in range(1, 7):
        assert again.verify_s(rows) == cost.verify_s(rows)
    assert again.plain_step_s() == cost.plain_step_s() and again.catch_up_s(3) == cost.catch_up_s(3)
    assert again.draft_forward_s(plan) == cost.draft_forward_s(plan)
    assert timed == [] and again.calibration_s == 0.0
    for other in (MeasuredCostModel(draft=draft, target=target, verify_width=5, context=32, padded=False),
                  MeasuredCostModel(draft=draft, target=target, verify_width=6, context=32, padded=True)):
        assert not other.restore(kept)
    fresh = MeasuredCostModel(draft=draft, target=target, verify_width=6, context=32, repeats=1, padded=False)
    fresh.restore({"verify_width": 6, "padded": False, "plain": "fast"})  # an unreadable timing is timed again
    fresh.plain_step_s()
    assert fresh.calibration_s > 0


def test_verify_timing_is_the_faster_of_two(target, draft, monkeypatch):
    """Before any verify round is seen, the verify costs the faster of two timed forwards: a first
    wide forward's one-time costs (or a noisy sample) would price every draft out, and no drafted
    round would ever correct it. Power check: the first timing alone is 3x too slow."""
    import autotune.tuning.cost_model as cm
    from autotune.timing import Timing

    samples = iter([3.0, 1.0])
    monkeypatch.setattr(cm, "time_calls", lambda fn, repeats, device, warm, setup: Timing((next(samples),), 1))
    cost = MeasuredCostModel(draft=draft, target=target, verify_width=5, context=32, repeats=1, warm=False)
    assert cost.verify_s() == 1.0 and cost.verify_s() == 1.0  # timed once, kept
    warms: list[bool] = []
    monkeypatch.setattr(cm, "time_calls", lambda fn, repeats, device, warm, setup: warms.append(warm) or Timing((1.0,), 1))
    MeasuredCostModel(draft=draft, target=target, verify_width=5, context=32, repeats=1, warm=True).verify_s()
    assert warms == [True, False]  # a warm-up forward before the first timing only, not before each


def test_a_burst_of_load_moves_the_plain_price_only_while_it_lasts(target, draft, monkeypatch):
    """Plain decoding's price is the median of the plain steps seen lately: a few rounds slowed by
    another process do not move the bar every candidate is judged against (an average would keep
    a share of them until many plain rounds follow, and under an incumbent that drafts they are
    rare). Power check: a mean of the same rounds moves it by more than 50%."""
    import autotune.tuning.cost_model as cm
    from autotune.timing import Timing

    monkeypatch.setattr(cm, "time_calls", lambda fn, repeats, device, warm, setup: Timing((1.0,), 1))
    cost = MeasuredCostModel(draft=draft, target=target, verify_width=5, context=32, repeats=1, padded=False)
    seen = [0.06] * 10 + [0.19] * 4
    for s in seen:
        cost.observe_plain(s)
    assert cost.plain_step_s() == pytest.approx(0.06)
    ema = 0.06  # the rule it replaced: each round moves the price by a fifth of the difference
    for s in seen[10:]:
        ema = 0.8 * ema + 0.2 * s
    assert ema > 1.5 * 0.06
    for s in [0.19] * 12:  # a slower machine for good: the price follows once most rounds say so
        cost.observe_plain(s)
    assert cost.plain_step_s() == pytest.approx(0.19)


def test_no_row_count_is_priced_above_a_wider_one(target, draft, monkeypatch):
    """A timed forward slower than one of more rows is noise (more rows, more work): plain
    decoding is priced at most at the two-row verify and every row count at most at any wider
    one, so one disturbed timing does not hand every draft a speed-up it does not have, or price
    a length out (nor, kept in the store, for the next study). Power checks: the timings alone
    are 3x (plain) and 3.6x (two rows) what they are priced at."""
    import autotune.tuning.cost_model as cm
    from autotune.timing import Timing

    times = {1: 0.3, 2: 0.1, 3: 0.12, 4: 0.14, 5: 0.16}

    def timed(fn, repeats, device, warm, setup):
        return Timing((times[timed.rows],), 1)

    real = MeasuredCostModel._forward_s

    def forward_s(self, lm, rows, plan, best_of=1, every_logit=False):
        timed.rows = rows
        return real(self, lm, rows, plan, best_of, every_logit)

    monkeypatch.setattr(cm, "time_calls", timed)
    monkeypatch.setattr(MeasuredCostModel, "_forward_s", forward_s)
    cost = MeasuredCostModel(draft=draft, target=target, verify_width=5, context=32, repeats=1, padded=False)
    assert cost._plain is None and cost.plain_step_s() == pytest.approx(0.1) and cost._plain == 0.3
    assert cost.verify_s(1.0) == pytest.approx(0.1) and cost.verify_s(3.0) == pytest.approx(0.12)
    cost.observe_verify(0.05, 2.0)  # verify rounds measured faster than timed: the cap follows them
    assert cost.verify_scale < 1.0 and cost.plain_step_s() == pytest.approx(0.1 * cost.verify_scale)
    padded = MeasuredCostModel(draft=draft, target=target, verify_width=5, context=32, repeats=1)
    assert padded.plain_step_s() == pytest.approx(0.16)  # padded: every verify runs the full width
    times[2] = 0.43  # a disturbed timing of two rows (4x three rows'), as kept by a study once
    noisy = MeasuredCostModel(draft=draft, target=target, verify_width=5, context=32, repeats=1, padded=False)
    noisy.verify_s(3.0), noisy.verify_s(4.0), noisy.verify_s(2.0)
    assert noisy._width[2] == 0.43  # power check: the timing itself is the disturbed one
    assert noisy.verify_s(2.0) == pytest.approx(0.12) and noisy.plain_step_s() == pytest.approx(0.12)


def test_verify_rounds_seen_price_their_row_count_and_are_kept(target, draft, monkeypatch):
    """A row count's price follows the verify rounds of that count decoded lately (their median,
    once ``SEEN_MIN`` were seen), not a timing taken once: one taken under load would otherwise
    price that length out for the whole study, and for every study after it (the store keeps what
    decoding measured). Power check: before the third round the inflated timing still prices it."""
    times = {1: 0.09, 2: 0.1, 3: 0.3, 4: 0.35, 5: 0.4}  # three rows timed under load

    def forward_s(self, lm, rows, plan, best_of=1, every_logit=False):
        return times[rows]

    monkeypatch.setattr(MeasuredCostModel, "_forward_s", forward_s)
    cost = MeasuredCostModel(draft=draft, target=target, verify_width=5, context=32, repeats=1, padded=False)
    cost.prepare()
    assert cost.verify_s(3.0) == pytest.approx(0.3)
    cost.observe_verify(0.12, 3.0)
    cost.observe_verify(0.12, 3.0)
    assert cost.verify_s(3.0) == pytest.approx(0.3 * cost.verify_scale)  # two seen: still the timing
    cost.observe_verify(0.13, 3.0)
    assert cost.verify_s(3.0) == pytest.approx(0.12)
    assert cost.verify_s(4.0) == pytest.approx(0.35 * cost.verify_scale)  # not seen: its timing, rescaled
    kept = cost.timings()
    assert kept["width"]["3"] == pytest.approx(0.12 / cost.verify_scale) and kept["width"]["4"] == 0.35
    again = MeasuredCostModel(draft=draft, target=target, verify_width=5, context=32, repeats=1, padded=False)
    assert again.restore(kept) and again.verify_s(3.0) == pytest.approx(0.12)


def test_prepare_times_each_row_count_twice_and_keeps_the_faster(target, draft, monkeypatch):
    """``prepare`` times every row count in two passes and keeps the faster of each: a burst of
    load seconds long slows one pass, not both. Power check: the first pass alone is disturbed."""
    calls: list[int] = []

    def forward_s(self, lm, rows, plan, best_of=1, every_logit=False):
        calls.append(rows)
        first = calls.count(rows) == 1
        return (0.5 if first and rows in (3, 4) else 0.1) + 0.01 * rows

    monkeypatch.setattr(MeasuredCostModel, "_forward_s", forward_s)
    cost = MeasuredCostModel(draft=draft, target=target, verify_width=6, context=32, repeats=1, padded=False)
    cost.prepare()
    assert [calls.count(r) for r in (2, 3, 4, 5)] == [2, 2, 2, 2]
    assert cost._width[3] == pytest.approx(0.13) and cost._width[4] == pytest.approx(0.14)


# ---------------------------------------------------------------------------------- the tuner
class SimClock:
    """Deterministic time for tuner tests: what the decoded rounds would cost under the same
    FixedCostModel prices (a target step ``verify`` s, each drafted token ``draft`` s); tuning is
    free. Measured decisions are then reproducible, and can be made to disagree with predictions."""

    def __init__(self, verify: float = 1.0, draft: float = 0.2) -> None:
        self.verify, self.draft, self.stats = verify, draft, DecodeStats()

    def __call__(self) -> float:
        return self.stats.target_forwards * self.verify + self.stats.drafted * self.draft

    def hook(self, tuner):
        def before_round(dec, tokens, cache, stats):
            self.stats = stats
            tuner.before_round(dec, tokens, cache, stats)
        return before_round


def self_spec_run(target: CausalLM, seed: int, n_new: int = 64, cost: FixedCostModel | None = None,
                  clock: SimClock | None = None, **changes):
    space = get_space("layer-skip")
    ctx = SpaceContext(n_layers=N_LAYERS, base=Strategy(drafter="layer-skip", layer_plan=uniform_skip_plan(N_LAYERS, 0.3)),
                       skip_ratio=0.3, max_draft_length=4)
    initial = space.uniform(ctx)
    decoder = Decoder(target, SelfDrafter(target, initial.layer_plan, tree_shape(initial)), initial.draft_length,
                      verify_width=5, kind="layer-skip")
    study = optuna.create_study(direction="maximize")
    settings = TunerSettings(**{**dict(window=8, beta=5, max_trials=30, patience=30, seed=seed, max_share=1.0,
                                       trials_per_round=2, confirm_tokens=8, min_trials=30), **changes})
    cost = cost or FixedCostModel(draft_full_s=0.2, verify_const_s=1.0)
    clock = clock or SimClock()
    tuner = OnlineTuner(space, ctx, study, cost, settings, initial, clock=clock)
    tuner.start_prompt(len(PROMPT))
    out = decoder.generate(PROMPT, GenerationConfig(max_new_tokens=n_new), before_round=clock.hook(tuner))
    tuner.end_prompt(PROMPT + out.tokens, out.stats)
    return out, tuner, study


def test_tuner_with_a_fixed_seed_is_reproducible_and_lossless(target):
    plain = Decoder(target).generate(PROMPT, GenerationConfig(max_new_tokens=64)).tokens
    a_out, a, a_study = self_spec_run(target, seed=8)
    b_out, b, b_study = self_spec_run(target, seed=8)
    assert a.state.trials > 10
    assert [t.params for t in a_study.trials] == [t.params for t in b_study.trials]
    assert [t.value for t in a_study.trials] == [t.value for t in b_study.trials]
    assert a.best == b.best and len(a.kept) == len(b.kept)
    # strategies switched between rounds never change the output
    assert a_out.tokens == b_out.tokens == plain
    assert a.kept[0].strategy == PLAIN and a.kept[0].tokens > 0  # plain decoding ran first
    assert any(k.strategy.speculates and k.trial >= 0 for k in a.kept)  # then it switched to a tuned candidate
    assert a.racing.switches and a.state.measured_trials >= len(a.racing.switches)
    assert a_out.stats.drafted > 0
    # the end of a prompt refreshes the kept strategy's correction with all it measured
    assert a.best.speculates and a.predicted_tps(a.best) == pytest.approx(a.incumbent.measured_tps)
    c_out, c, c_study = self_spec_run(target, seed=7)
    assert [t.params for t in c_study.trials] != [t.params for t in a_study.trials]
    assert c_out.tokens == plain


def test_tuner_stops_after_max_trials_and_records_kept(target):
    _, tuner, study = self_spec_run(target, seed=1, rush_margin=None)  # no measured trial interrupts the trials
    assert tuner.state.trials == 30 and tuner.state.done and tuner.state.stop_reason == "30 trials"
    assert len(study.trials) >= 30  # flushed from the working study at the end of the prompt
    summary = tuner.summary()
    assert summary["trials"] == 30 and summary["plain_predicted_tps"] == pytest.approx(1 / 1.0)
    assert all(k["predicted_tps"] >= 0 for k in summary["kept"])
    assert any(k["measured_tps"] for k in summary["kept"])
    assert {t.user_attrs["sampler"] for t in study.trials if t.state.is_finished() and t.user_attrs} <= {"random", "bayes", "enqueued"}


def test_tuner_decodes_plainly_while_no_candidate_beats_plain(target):
    """Drafting priced far above a target step: plain decoding (a point of every space) is the
    incumbent from the first round and nothing is ever drafted."""
    plain = Decoder(target).generate(PROMPT, GenerationConfig(max_new_tokens=48)).tokens
    out, tuner, _ = self_spec_run(target, seed=3, n_new=48, cost=FixedCostModel(draft_full_s=10.0, verify_const_s=1.0),
                                  clock=SimClock(draft=10.0))
    assert out.tokens == plain
    assert tuner.best == PLAIN and tuner.state.trials > 0 and len(tuner.kept) == 1
    assert out.stats.drafted == 0 and tuner.state.measured_trials == 0


def test_a_challenger_that_measures_slower_goes_back_to_the_incumbent(target):
    """Predicted fast (drafting priced at 0.2 s) but measured slow (the clock charges 3 s per
    drafted token): the measured trial loses, decoding returns to plain, and the strategy's
    correction learns the gap, so its predictions drop to what was measured."""
    plain = Decoder(target).generate(PROMPT, GenerationConfig(max_new_tokens=64)).tokens
    out, tuner, _ = self_spec_run(target, seed=7, clock=SimClock(draft=3.0))
    assert out.tokens == plain
    assert tuner.state.measured_trials >= 1 and tuner.racing.rejected and tuner.best == PLAIN
    lost = tuner.racing.rejected[0]
    assert lost.measured_tps < tuner.kept[0].recent_tps
    last = tuner.racing.rejected[-1]
    # measured over the mean of its uncorrected predictions on the windows it raced and decoded,
    # over every measured trial of that strategy (autotune.tuning.corrections), within the range
    trials = [k for k in tuner.racing.rejected if k.strategy == last.strategy]
    raws = [r for k in trials for r in k.raws]
    measured = sum(k.tokens for k in trials) / sum(k.seconds for k in trials)
    lo, hi = CORRECTION_RANGE
    assert tuner.correction(last.strategy) == pytest.approx(min(max(measured / (sum(raws) / len(raws)), lo), hi))
    assert tuner.correction(last.strategy) < 1.0
    assert tuner.summary()["rejected"][0]["measured_tps"] == pytest.approx(lost.measured_tps)


class ShiftingClock(SimClock):
    """Drafting turns expensive after ``after`` target forwards (the text changed under a kept strategy)."""

    def __init__(self, after: int) -> None:
        super().__init__(verify=1.0, draft=0.05)
        self.after = after

    def __call__(self) -> float:
        s = self.stats
        return s.target_forwards * self.verify + s.drafted * (0.05 if s.target_forwards < self.after else 3.0)


def test_a_kept_strategy_that_turns_slower_than_what_it_replaced_is_reverted(target):
    """A measured trial is one stretch of text: a kept strategy stays on probation, and once it
    measured slower than the incumbent it replaced over its whole stretch, decoding reverts."""
    plain = Decoder(target).generate(PROMPT, GenerationConfig(max_new_tokens=96)).tokens
    out, tuner, _ = self_spec_run(target, seed=8, n_new=96, clock=ShiftingClock(after=30), probation_tokens=12)
    assert out.tokens == plain
    assert tuner.racing.reverted, tuner.summary()
    gone = tuner.racing.reverted[0]
    assert gone.replaced is not None and gone.measured_tps < gone.replaced.measured_tps
    assert tuner.summary()["reverted"][0]["measured_tps"] == pytest.approx(gone.measured_tps)


def test_probation_reverts_beyond_the_margin_only(target):
    """Kept and replaced strategies measured on different stretches of text: a gap within
    ``switch_margin`` is noise and keeps the strategy; a larger one reverts to the replaced."""
    for kept_tps, reverted in ((97.0, False), (90.0, True)):
        _, tuner, _ = self_spec_run(target, seed=8, n_new=8, switch_margin=0.05, probation_tokens=12)
        before = Kept(PLAIN, trial=-1, predicted_tps=100.0, matchness=0.0, tokens=100, seconds=1.0)
        kept = Kept(Strategy(drafter="prompt-lookup", draft_length=4), trial=3, predicted_tps=110.0, matchness=0.5,
                    tokens=int(kept_tps), seconds=1.0, replaced=before)
        tuner.incumbent, tuner.racing.challenger = kept, None
        tuner.racing.probation(Decoder(target))
        assert (tuner.incumbent is before) == reverted and bool(tuner.racing.reverted) == reverted


def test_a_candidate_must_keep_winning_on_fresh_windows(target):
    """With an impossible margin no candidate races: plain decoding stays, nothing is measured
    (no rival measured at the stop either: ``rival_margin=None``), and the incumbent's
    score is its measured speed on the latest window."""
    cost = FixedCostModel(draft_full_s=1.0, verify_const_s=1.0)  # speculation can never look 2x plain
    out, tuner, _ = self_spec_run(target, seed=7, switch_margin=0.99, cost=cost, clock=SimClock(draft=1.0),
                                  rival_margin=None)
    assert tuner.state.trials > 0 and tuner.best == PLAIN and len(tuner.kept) == 1
    assert tuner.state.measured_trials == 0 and out.stats.drafted == 0
    assert tuner.state.best_score == pytest.approx(tuner.incumbent.recent_tps)


def test_a_stable_incumbent_stops_tuning(target):
    """Once the incumbent led on stop_windows windows in a row (and min_trials ran), trials stop;
    the tuner watches: later windows are still scored (no trial runs), and a candidate beating
    the incumbent on one resumes tuning. Power check: with every candidate beating it, the
    watching tuner resumes."""
    _, tuner, _ = self_spec_run(target, seed=7, switch_margin=0.99, stop_windows=2, min_trials=2, max_trials=1000,
                                patience=1000, n_new=128, cost=FixedCostModel(draft_full_s=1.0, verify_const_s=1.0))
    assert tuner.state.done and tuner.state.watching and "led on 2 windows" in tuner.state.stop_reason
    watcher = OnlineTuner(get_space("lookup"), SpaceContext(n_layers=N_LAYERS, max_draft_length=4),
                          optuna.create_study(direction="maximize"), FixedCostModel(draft_full_s=0.0, verify_const_s=1.0),
                          TunerSettings(window=8), clock=SimClock())
    watcher.state.done = watcher.state.watching = True
    decoder = Decoder(target, PromptLookupDrafter(max_ngram=3), 4, verify_width=5, kind="prompt-lookup")
    fresh = list(range(1, 39))  # nothing recurs: plain decoding keeps leading
    watcher._new_window(decoder, fresh)
    assert watcher.state.windows == 1 and watcher.state.trials == 0 and watcher.state.done
    repeating = fresh + fresh[:24]  # the text moved: prompt lookup copies it now
    watcher._new_window(decoder, repeating)
    assert not watcher.state.done and watcher.state.resumed == 1
    assert watcher.racing.race or watcher.challenger is not None  # racing (or measured at once)


def test_a_stop_measures_the_closest_candidate_once(target):
    """A tuner stopping on predictions (the incumbent led on ``stop_windows`` windows) first
    measures the candidate scored nearest the incumbent, when within ``rival_margin`` of it
    (the default 10%; here one scored 0.98x plain decoding): one measured trial, decided like any
    other, before it watches. Power check: with ``rival_margin=None`` the same run stops with
    nothing measured, and with a margin of 0 that rival (below plain) is not measured."""
    plain = Decoder(target).generate(PROMPT, GenerationConfig(max_new_tokens=128)).tokens
    runs = {}
    for margin in (TunerSettings().rival_margin, None, 0.0):
        out, tuner, _ = self_spec_run(target, seed=7, switch_margin=0.99, stop_windows=2, min_trials=2,
                                      max_trials=1000, patience=1000, n_new=128, rival_margin=margin,
                                      cost=FixedCostModel(draft_full_s=1.5, verify_const_s=1.0),
                                      clock=SimClock(draft=1.5))
        assert out.tokens == plain
        assert "led on 2 windows" in tuner.state.stop_reason
        runs[margin] = tuner
    closed = runs[0.1]
    assert closed.state.rival_trials == 1 and closed.state.measured_trials == 1
    trial = closed.racing.rejected[0]  # measured slower than plain decoding (as the clock charges): lost
    assert trial.strategy.speculates and trial.tokens >= 8 and trial.trial >= 0
    assert 0.9 <= trial.predicted_tps / closed.kept[0].predicted_tps < 1.0  # it was scored just below plain
    assert trial.measured_tps < trial.bar_tps and closed.best == PLAIN
    assert closed.summary()["rival_trials"] == 1
    for margin in (None, 0.0):
        assert runs[margin].state.rival_trials == runs[margin].state.measured_trials == 0


def lookup_run(target: CausalLM, **changes):
    """The `lookup` space tuned on the tiny target's greedy output (it repeats itself: prompt
    lookup accepts there), 128 tokens. The cost model prices each verify row past the first like
    a whole step, so lookup scores no faster than plain decoding (share <= 1), while the clock
    charges target steps only: a lookup trial measures faster than its prediction. Nothing
    joins the race (``switch_margin`` 0.99); only a rival measurement can switch."""
    space, ctx = get_space("lookup"), SpaceContext(n_layers=N_LAYERS, max_draft_length=4)
    decoder = Decoder(target, PromptLookupDrafter(max_ngram=3), 4, verify_width=5, kind="prompt-lookup")
    settings = TunerSettings(**{**dict(window=8, max_share=1.0, trials_per_round=2, confirm_tokens=8, seed=7,
                                       switch_margin=0.99, stop_windows=2, min_trials=2, max_trials=1000,
                                       patience=1000), **changes})
    clock = SimClock(draft=0.0)
    tuner = OnlineTuner(space, ctx, optuna.create_study(direction="maximize"),
                        FixedCostModel(draft_full_s=0.0, verify_const_s=1.0, verify_row_s=1.0), settings, clock=clock)
    tuner.start_prompt(len(PROMPT))
    out = decoder.generate(PROMPT, GenerationConfig(max_new_tokens=128), before_round=clock.hook(tuner))
    tuner.end_prompt(PROMPT + out.tokens, out.stats)
    return out, tuner


def test_a_rival_that_measures_faster_at_a_stop_replaces_the_incumbent_and_tuning_resumes(target):
    """The stop's rival measurement decides like any measured trial: a rival scored within
    ``rival_margin`` below plain decoding but measured faster replaces it, the stop is void and
    the tuner resumes; the output stays plain decoding's. Power check: with ``rival_margin=None``
    the same stream stops on plain decoding, nothing measured, nothing drafted."""
    plain = Decoder(target).generate(PROMPT, GenerationConfig(max_new_tokens=128)).tokens
    out, tuner = lookup_run(target)
    assert out.tokens == plain and out.stats.drafted > 0
    first = tuner.kept[1]  # the first switch: a rival measured at a stop
    assert tuner.racing.switches[0] == first.trial and tuner.state.resumed >= 1
    assert tuner.state.rival_trials == tuner.state.measured_trials >= 1
    assert first.strategy.drafter == "prompt-lookup" and first.replaced is tuner.kept[0]
    assert 0.9 <= first.predicted_tps / tuner.kept[0].predicted_tps <= 1.0  # scored no faster than plain
    assert first.measured_tps > first.bar_tps  # and measured faster
    assert tuner.best.speculates and tuner.summary()["rival_trials"] == tuner.state.rival_trials
    out, off = lookup_run(target, rival_margin=None)
    assert out.tokens == plain and out.stats.drafted == 0
    assert off.best == PLAIN and off.state.measured_trials == 0 and "led on 2 windows" in off.state.stop_reason


def test_predictions_alone_rule_for_at_most_stop_windows_windows(target):
    """A tuner that never stops (``min_trials`` out of reach) still measures the incumbent's
    nearest rival once ``stop_windows`` windows passed with no measured trial, and the rival
    that measures faster switches. Power check: with ``stop_windows`` beyond the stream's windows,
    or ``rival_margin=None``, nothing is measured."""
    plain = Decoder(target).generate(PROMPT, GenerationConfig(max_new_tokens=128)).tokens
    out, tuner = lookup_run(target, min_trials=10**6, stop_windows=3)
    assert out.tokens == plain and not tuner.state.done and tuner.state.resumed == 0
    assert tuner.state.rival_trials == tuner.state.measured_trials >= 2  # one after each unmeasured stretch
    assert tuner.racing.switches and tuner.best.drafter == "prompt-lookup"
    for changes in (dict(stop_windows=100), dict(stop_windows=3, rival_margin=None)):
        out, idle = lookup_run(target, min_trials=10**6, **changes)
        assert out.tokens == plain and idle.state.windows > 3
        assert idle.state.measured_trials == 0 and idle.best == PLAIN


def joint_decoder(target, draft, width=7):
    """A decoder holding every drafter kind of the joint space: plain decoding drafting nothing,
    a draft model and prompt lookup on standby (what `autotune study` builds)."""
    first = Strategy(draft_length=4, confidence_threshold=0.0)
    decoder = Decoder(target, ModelDrafter(draft, target.dims.vocab, tree_shape(first)), 4, verify_width=width,
                      kind="draft-model")
    decoder.standby["prompt-lookup"] = PromptLookupDrafter()
    decoder.apply(PLAIN)
    return decoder


def test_apply_switches_kinds_mid_sequence_losslessly(target, draft):
    """Decoder.apply between rounds: plain, a draft model chain / layer-parallel plan / tree, and
    prompt lookup, in turn; drafters on standby follow the sequence, so every switch drafts from
    the right context and the output equals plain decoding."""
    plain = Decoder(target).generate(PROMPT, GenerationConfig(max_new_tokens=48)).tokens
    strategies = [
        PLAIN,
        Strategy(draft_length=4, confidence_threshold=0.0),
        Strategy(drafter="prompt-lookup", draft_length=3),
        Strategy(draft_length=3, layer_plan=easyspec_plan(N_LAYERS, 3), calibrate=True),
        PLAIN,
        Strategy(draft_length=2, layer_plan=easyspec_plan(N_LAYERS, 2), calibrate=False),
        Strategy(draft_length=3, tree_widths=(2, 2, 1)),
    ]
    decoder = joint_decoder(target, draft, width=11)
    rounds = iter(range(10**6))
    kinds = []

    def hook(dec, tokens, cache, stats):
        dec.apply(strategies[next(rounds) % len(strategies)])
        kinds.append(dec.kind)

    out = decoder.generate(PROMPT, GenerationConfig(max_new_tokens=48), before_round=hook)
    assert out.tokens == plain
    assert out.stats.drafted > 0 and {None, "draft-model", "prompt-lookup"} <= set(kinds)
    # a draft model on standby catches up exactly: after sync its cache equals a fresh prefill
    drafter = decoder.drafter_of("draft-model")
    decoder.apply(PLAIN)
    decoder.generate(PROMPT, GenerationConfig(max_new_tokens=20))
    full = PROMPT + plain[:20]
    drafter.sync()
    assert drafter.cache.length == len(full) - 1 and drafter.pending == full[-1:]
    ref = prefilled(draft, full, len(full) - 1)
    n = len(full) - 1
    assert torch.allclose(drafter.cache.all_keys[:, :, :n], ref.all_keys[:, :, :n], atol=1e-5)
    assert torch.allclose(drafter.cache.all_values[:, :, :n], ref.all_values[:, :, :n], atol=1e-5)


def test_standby_catch_up_scores_the_window_it_runs(target, draft):
    """A draft on standby scores its own (all layers) plan from the catch-up forward: the same
    matchness as a scratch forward over a fresh prefill, and the cache then follows the sequence
    exactly, as ``sync`` leaves it."""
    tokens = plain_tokens(target, 30)
    drafter = ModelDrafter(draft, 40)
    drafter.begin(tokens[:len(PROMPT) + 1], len(tokens) + 8)
    drafter.observe(0, tokens[len(PROMPT) + 1:], [])  # decoded without it: all pending
    # a window ending before the latest token: what follows it stays pending
    early = drafter.sync_scoring(tokens[:-3], 8)
    ref = matchness(draft, prefilled(draft, tokens, len(tokens) - 12), None, tokens[:-3], 8)
    assert torch.equal(score_logits(early, torch.tensor(tokens[-11:-3])).hits, ref.hits)
    assert drafter.cache.length == len(tokens) - 4 and drafter.pending == tokens[-4:]
    drafter.cache.rollback(len(tokens) - 12)  # as it was, to score the latest window from the catch-up
    drafter.pending = tokens[len(tokens) - 12:]
    del drafter.exact_rows[len(tokens) - 12:]
    logits = drafter.sync_scoring(tokens, 8)
    assert logits is not None and logits.shape[0] == 8
    got = score_logits(logits, torch.tensor(tokens[-8:]))
    ref = matchness(draft, prefilled(draft, tokens, len(tokens) - 9), None, tokens, 8)
    assert torch.equal(got.hits, ref.hits) and torch.allclose(got.confidence, ref.confidence, atol=1e-5)
    n = len(tokens) - 1
    assert drafter.cache.length == n and drafter.pending == tokens[-1:]
    fresh = prefilled(draft, tokens, n)
    assert torch.allclose(drafter.cache.all_keys[:, :, :n], fresh.all_keys[:, :, :n], atol=1e-5)
    assert drafter.sync_scoring(tokens, 8) is None  # nothing left to catch up: the caller scores from the cache


def test_a_draft_keeps_the_prefix_its_next_prompt_shares(target, draft):
    """Few-shot prompts share a long prefix: a draft model keeps those exact rows across
    sequences (also when its cache must grow), drafts exactly as after a fresh prefill, and the
    output stays plain decoding's."""
    strategy = Strategy(draft_length=4, confidence_threshold=0.0)
    shared = PROMPT + [33, 21, 8, 14, 2, 19]
    first, second = shared + [4, 4, 9], shared + [27, 11]
    decoder = Decoder(target, ModelDrafter(draft, 40, tree_shape(strategy)), draft_length=4, verify_width=6)
    decoder.generate(first, GenerationConfig(max_new_tokens=12))
    drafter = decoder.drafter
    assert drafter.exact_rows[:len(first)] == first
    out = decoder.generate(second, GenerationConfig(max_new_tokens=40))
    fresh = Decoder(target, ModelDrafter(draft, 40, tree_shape(strategy)), draft_length=4, verify_width=6)
    ref = fresh.generate(second, GenerationConfig(max_new_tokens=40))
    assert out.tokens == ref.tokens == Decoder(target).generate(second, GenerationConfig(max_new_tokens=40)).tokens
    assert out.stats.drafted > 0 and out.stats.accepted == ref.stats.accepted
    # the kept rows equal a fresh prefill's; a longer prompt grows the cache and keeps them too
    n = len(shared)
    ref_cache = prefilled(draft, second, n)
    assert torch.allclose(drafter.cache.all_keys[:, :, :n], ref_cache.all_keys[:, :, :n], atol=1e-5)
    capacity = drafter.cache.capacity
    drafter.begin(shared + list(range(1, 60)), capacity + 80)
    assert drafter.cache.capacity >= capacity + 80 and drafter.cache.length == n
    assert drafter.pending == list(range(1, 60))
    assert torch.allclose(drafter.cache.all_keys[:, :, :n], ref_cache.all_keys[:, :, :n], atol=1e-5)


def test_apply_refuses_what_the_decoder_cannot_do(target, draft):
    decoder = joint_decoder(target, draft)
    with pytest.raises(RuntimeUserError, match="no 'layer-skip' drafter"):
        decoder.apply(Strategy(drafter="layer-skip", layer_plan=uniform_skip_plan(N_LAYERS, 0.3)))
    with pytest.raises(RuntimeUserError, match="verify width"):
        decoder.apply(Strategy(draft_length=4, tree_widths=(4, 2, 1, 1)))


def joint_tuner(target, draft, **changes):
    """The `auto` space over plain / lookup / a tiny draft model, drafting priced cheap (0.05 s a
    forward against a 1 s target step) and the clock agreeing: -> (decoder, tuner, clock)."""
    ctx = SpaceContext(n_layers=N_LAYERS, draft_layers=N_LAYERS, max_draft_length=6)
    clock = SimClock(verify=1.0, draft=0.05)
    settings = TunerSettings(**{**dict(window=8, beta=4, max_share=1.0, confirm_tokens=8), **changes})
    tuner = OnlineTuner(get_space("auto"), ctx, optuna.create_study(direction="maximize"),
                        FixedCostModel(draft_full_s=0.05, verify_const_s=1.0), settings, clock=clock)
    return joint_decoder(target, draft), tuner, clock


def test_joint_space_tunes_across_kinds_losslessly(target, draft):
    """The `auto` space on tiny models: trials cover plain, lookup and the draft model (trees and
    layer-parallel plans included), output equals plain decoding, and a speculating candidate
    ends up decoding (drafting is priced cheap and the clock agrees)."""
    plain = Decoder(target).generate(PROMPT, GenerationConfig(max_new_tokens=96)).tokens
    decoder, tuner, clock = joint_tuner(target, draft, max_trials=60, patience=60, trials_per_round=4, min_trials=60)
    tuner.start_prompt(len(PROMPT))
    out = decoder.generate(PROMPT, GenerationConfig(max_new_tokens=96), before_round=clock.hook(tuner))
    tuner.end_prompt(PROMPT + out.tokens, out.stats)
    assert out.tokens == plain
    trials = [t for t in tuner.study.trials if t.state.is_finished() and t.params]
    assert {t.params["drafter"] for t in trials} == {"none", "prompt-lookup", "draft-model"}
    assert {t.user_attrs["sampler"] for t in trials} >= {"random", "bayes"}
    assert tuner.best.speculates and out.stats.drafted > 0  # a speculating candidate won its measured trial


def test_tuning_goes_on_across_prompts(target, draft):
    """Each prompt starts with the drafters on a new sequence: trials before its first window score
    the previous prompt's window (plans cached there only), and windows go on being scored."""
    decoder, tuner, clock = joint_tuner(target, draft, max_trials=500, patience=500, trials_per_round=2,
                                        min_trials=500)
    seen = []
    for prompt in (PROMPT, PROMPT[::-1] + [7, 7]):
        tuner.start_prompt(len(prompt))
        out = decoder.generate(prompt, GenerationConfig(max_new_tokens=40), before_round=clock.hook(tuner))
        tuner.end_prompt(prompt + out.tokens, out.stats)
        assert out.tokens == Decoder(target).generate(prompt, GenerationConfig(max_new_tokens=40)).tokens
        seen.append((tuner.state.windows, tuner.state.trials))
    assert seen[1][0] > seen[0][0] and seen[1][1] > seen[0][1]


def test_free_families_are_swept_on_every_fresh_window(target, draft):
    """A reference point (the draft's chain, prompt lookup) scored once on an unrepresentative
    window would be ruled out for good; instead every point of the free families (the draft's
    all-layer plan and prompt lookup at every grid length, threshold and tree head: their plans'
    matches are cached on the window, no forward of their own) is scored on every fresh window."""
    decoder, tuner, clock = joint_tuner(target, draft, max_trials=500, patience=500, trials_per_round=1,
                                        min_trials=500, switch_margin=0.99)  # few races
    windows: dict[Strategy, set[tuple[int, ...]]] = {}
    score = tuner.score

    def spy(dec, strategy, tokens):
        windows.setdefault(strategy, set()).add(tuple(tokens))
        return score(dec, strategy, tokens)

    tuner.score = spy
    tuner.start_prompt(len(PROMPT))
    out = decoder.generate(PROMPT, GenerationConfig(max_new_tokens=96), before_round=clock.hook(tuner))
    assert out.tokens == Decoder(target).generate(PROMPT, GenerationConfig(max_new_tokens=96)).tokens
    assert tuner.state.windows >= 4
    space = get_space("auto")
    free = [s for s in space.seeds(tuner.ctx) if s.layer_plan is None or s.layer_plan.is_identity]
    assert {s.drafter for s in free} == {"draft-model", "prompt-lookup"} and len(free) >= 3
    grid = {p for s in free for p in space.sweep(s, tuner.ctx)}
    assert {p.draft_length for p in grid if p.drafter == "draft-model"} == {2, 4, 6}  # max_draft_length=6
    assert {p.draft_length for p in grid if p.drafter == "prompt-lookup"} == {2, 3, 4, 5, 6}  # every length
    grid |= set(free)
    assert {p.confidence_threshold for p in grid if p.drafter == "draft-model"} == {0.0, 0.3, 0.6}
    assert any(p.tree_widths for p in grid)  # trees are free too (top-w hits of the same forward)
    assert tuner.state.swept >= len(grid) * (tuner.state.windows - 1)
    for point in grid:  # every point scored on every window (racing ones as racers), the first excepted
        assert len(windows[point]) >= tuner.state.windows - 1, (point, len(windows[point]), tuner.state.windows)


def test_a_swept_winner_races_and_is_told_as_a_trial(target, draft):
    """Drafting priced cheap: a swept point beats plain decoding on a window, joins the race as a
    trial of sampler ``sweep`` (so the Bayesian sampler learns from it), and output stays plain's."""
    decoder, tuner, clock = joint_tuner(target, draft, max_trials=500, patience=500, trials_per_round=1,
                                        min_trials=500)
    tuner.start_prompt(len(PROMPT))
    out = decoder.generate(PROMPT, GenerationConfig(max_new_tokens=64), before_round=clock.hook(tuner))
    assert out.tokens == Decoder(target).generate(PROMPT, GenerationConfig(max_new_tokens=64)).tokens
    swept = [t for t in tuner.study.trials if t.user_attrs.get("sampler") == "sweep"]
    assert swept and all(t.state.is_finished() and t.value > 0 for t in swept)
    space = get_space("auto")
    for t in swept:  # each is the point it names, and a point of the space
        assert space.encode(space.define(optuna.trial.FixedTrial(t.params), tuner.ctx), tuner.ctx) == t.params
    assert tuner.state.measured_trials >= 1


def test_a_live_tuner_defers_a_catch_up_its_allowance_does_not_cover(target, draft):
    """``defer_catch_up`` (serve's re-tunes): a draft on standby scores a window only once the
    tuning allowance covers its catch-up over the text it has not seen. Priced at 1 s a row
    against 5% of decode time, it never fits: no draft-model point is scored, the draft never
    runs, lookup is still tuned. Power check: without it the same tuner scores the draft."""
    drafted_kinds = {}
    for defer in (True, False):
        ctx = SpaceContext(n_layers=N_LAYERS, draft_layers=N_LAYERS, max_draft_length=6)
        clock = SimClock(verify=1.0, draft=0.05)
        settings = TunerSettings(window=8, beta=4, max_share=0.05, confirm_tokens=8, max_trials=500, patience=500,
                                 min_trials=500, defer_catch_up=defer)
        cost = FixedCostModel(draft_full_s=0.05, verify_const_s=1.0, catch_up_row_s=1.0)
        tuner = OnlineTuner(get_space("auto"), ctx, optuna.create_study(direction="maximize"), cost, settings,
                            clock=clock)
        decoder = joint_decoder(target, draft)
        tuner.start_prompt(len(PROMPT))
        out = decoder.generate(PROMPT, GenerationConfig(max_new_tokens=64), before_round=clock.hook(tuner))
        tuner.end_prompt(PROMPT + out.tokens, out.stats)
        assert out.tokens == Decoder(target).generate(PROMPT, GenerationConfig(max_new_tokens=64)).tokens
        scored = [t for t in tuner.trials.study.trials if t.state == optuna.trial.TrialState.COMPLETE]
        drafted_kinds[defer] = {t.user_attrs["drafter"] for t in scored}
        caught_up = decoder.drafter_of("draft-model").cache.length
        assert (caught_up == 0) == defer, (defer, caught_up)
    assert "prompt-lookup" in drafted_kinds[True] and "draft-model" not in drafted_kinds[True]
    assert "draft-model" in drafted_kinds[False]


def test_lookup_replay_matches_a_brute_force_count():
    tokens = [1, 2, 3, 4, 9, 1, 2, 3, 4, 7, 1, 2, 3, 5, 1, 2, 3, 4, 9, 1, 2]
    window, k = 10, 4
    got = lookup_match(tokens, window, k)
    n = len(tokens)
    for j, i in enumerate(range(n - window, n)):
        lookup = PromptLookupDrafter()
        lookup.begin(tokens[:i], 0)
        guess = lookup.propose(k, SamplingParams(), torch.Generator()).tokens.tolist()
        accepted = next((a for a in range(len(guess)) if i + a >= n or guess[a] != tokens[i + a]), len(guess))
        assert (got.proposed[j], got.accepted[j]) == (len(guess), accepted)
    assert 0 < got.rate <= 1
    cost = FixedCostModel(draft_full_s=0.0, verify_const_s=2.0)
    p = predict_lookup(Strategy(drafter="prompt-lookup", draft_length=2), got, cost)
    assert p.draft_seconds == 0 and 1.0 <= p.tokens_per_round <= 3.0


def test_lengths_are_compared_on_the_same_start_positions():
    """With one horizon every length is replayed from the same positions, so at one verify width a
    longer lookup never predicts slower; judged each on its own positions, shorter lengths are
    credited with the window's tail too (here where the copying is), which narrows the gap
    between lengths or reverses it (the bias the horizon removes)."""
    copied = list(range(200, 220))
    tokens = list(range(100, 120)) + copied + list(range(300, 310)) + copied  # the window: 10 new, then a copy
    match = lookup_match(tokens, 30, 12)
    cost = FixedCostModel(draft_full_s=0.0, verify_const_s=1.0)
    own = [predict_lookup(Strategy(drafter="prompt-lookup", draft_length=k), match, cost).tokens_per_s
           for k in (2, 4, 6, 8, 10, 12)]
    same = [predict_lookup(Strategy(drafter="prompt-lookup", draft_length=k), match, cost, horizon=12).tokens_per_s
            for k in (2, 4, 6, 8, 10, 12)]
    assert all(a <= b for a, b in zip(same, same[1:])) and same[-1] > same[0]
    assert own != same
    chain = synthetic([True] * 20 + [False] * 4, [1.0] * 24)
    for k in (2, 4, 8):  # the horizon only chooses positions: all-hit positions give k accepted either way
        assert replay(Strategy(draft_length=k, confidence_threshold=0.0), chain, horizon=12)[0] == k


def test_lookup_first_prediction_mixes_copied_and_drafted_rounds():
    """``lookup_first``: a chain checks the copy, so it accepts what the model alone would, and
    each copied token the draft keeps (at most the copy's accepted prefix) saves a draft forward,
    while the copy's rows join the first forward. A tree's lookup round is the copy alone (its
    accepted copy, one verify, no draft forward). No copy anywhere: the model's prediction."""
    cost = FixedCostModel(draft_full_s=0.1, verify_const_s=1.0, catch_up_row_s=0.01)
    match = synthetic([True] * 24, [1.0] * 24)
    s = Strategy(draft_length=4, confidence_threshold=0.0, lookup_first=True)
    everywhere = LookupMatch((4,) * 24, (2,) * 24)
    nowhere = LookupMatch((0,) * 24, (0,) * 24)
    plain_model = predict(replace(s, lookup_first=False), match, cost, 12)
    assert plain_model.tokens_per_round == 5.0 and plain_model.draft_seconds == pytest.approx(0.4)
    got = predict_lookup_first(s, match, nowhere, cost, 12)
    assert got.tokens_per_round == plain_model.tokens_per_round
    assert got.seconds_per_round == pytest.approx(plain_model.seconds_per_round)
    checked = predict_lookup_first(s, match, everywhere, cost, 12)
    assert checked.tokens_per_round == 5.0  # the model's drafts, not the copy's 2 + 1
    assert checked.draft_seconds == pytest.approx(0.1 + 4 * 0.01 + 1 * 0.1)  # 2 of 3 further forwards saved
    half = LookupMatch((4, 0) * 12, (1, 0) * 12)  # copies accept 1 where the model accepts 4
    mixed = predict_lookup_first(s, match, half, cost, 12)
    assert mixed.tokens_per_round == 5.0 and checked.draft_seconds < mixed.draft_seconds < plain_model.draft_seconds
    tree = replace(s, tree_widths=(2, 1, 1, 1))
    lookup = Strategy(drafter="prompt-lookup", draft_length=4)
    assert predict_lookup_first(tree, match, everywhere, cost, 12) == predict_lookup(lookup, everywhere, cost, 12)


def test_settings_are_validated():
    with pytest.raises(SpaceError, match="window"):
        TunerSettings(window=0)
    with pytest.raises(SpaceError, match="switch_margin"):
        TunerSettings(switch_margin=1.0)
    with pytest.raises(SpaceError, match="max_share"):
        TunerSettings(max_share=0.0)
    with pytest.raises(SpaceError, match="match_threshold"):
        TunerSettings(match_threshold=1.5)
    with pytest.raises(SpaceError, match="rival_margin"):
        TunerSettings(rival_margin=1.0)


def test_time_between_prompts_accrues_no_tuning_allowance():
    """The allowance is ``max_share`` of decode time: the time between one prompt's end and the
    next one's start (an idle server, or `study --baseline` decoding the prompt plainly) adds
    nothing. Power check: without the pause the 100 s gap would add 10 s of allowance."""
    now = [0.0]
    tuner = OnlineTuner(get_space("lookup"), SpaceContext(n_layers=2, max_draft_length=4),
                        optuna.create_study(direction="maximize"), FixedCostModel(draft_full_s=0.0, verify_const_s=1.0),
                        TunerSettings(max_share=0.1), clock=lambda: now[0])
    tuner.start_prompt(3)
    tuner.budget.accrue(0.0)
    now[0] = 10.0
    tuner.budget.accrue(now[0])  # 10 s of decoding
    assert tuner.budget.allowance == pytest.approx(1.0)
    tuner.end_prompt([1, 2, 3], DecodeStats())
    now[0] = 110.0  # 100 s outside decoding
    tuner.start_prompt(3)
    now[0] = 120.0
    tuner.budget.accrue(now[0])  # 10 s more of decoding
    assert tuner.budget.allowance == pytest.approx(2.0)


def test_timing_the_cost_model_is_one_time_and_never_starves_trials(target):
    """The cost model's timing is a one-time cost of the models on this machine (a study keeps it in
    the store): reported as ``calibration_s``, apart from the per-window ``tuning_s``, and not spent
    from the allowance, so trials go on at the next windows. Power check: held against the
    allowance (as before), 5 s of timing left one window scored in 96 s of decoding at 2%, and the
    rounds after it waited."""

    class SlowToTime(FixedCostModel):
        calibration_s = 0.0

        def verify_s(self, rows: float | None = None) -> float:
            self.calibration_s = 5.0  # the first price costs 5 s of timing forwards
            return super().verify_s(rows)

    cost = SlowToTime(draft_full_s=0.0, verify_const_s=1.0)
    sim = SimClock(verify=1.0, draft=0.0)
    clock = lambda: sim() + cost.calibration_s  # noqa: E731
    ctx = SpaceContext(n_layers=N_LAYERS, max_draft_length=4)
    tuner = OnlineTuner(get_space("lookup"), ctx, optuna.create_study(direction="maximize"), cost,
                        TunerSettings(window=8, max_share=0.02, trials_per_round=1, min_trials=1000), clock=clock)
    decoder = Decoder(target, PromptLookupDrafter(max_ngram=3), 4, verify_width=5, kind="prompt-lookup")
    prompt = PROMPT * 3
    tuner.start_prompt(len(prompt))
    out = decoder.generate(prompt, GenerationConfig(max_new_tokens=96), before_round=sim.hook(tuner))
    tuner.end_prompt(prompt + out.tokens, out.stats)
    assert tuner.state.calibration_s == 5.0 and tuner.state.tuning_s < 1.0  # reported apart
    assert tuner.state.windows >= 3 and tuner.state.trials >= 3  # tuning went on after it
    assert tuner.budget.allowance > -1.0  # nothing of the 5 s was spent from it


def test_a_candidate_priced_far_ahead_is_measured_at_once(target):
    """``rush_margin``: a candidate the window prices that far above the incumbent starts its
    measured trial on the window where it joined, so the stream runs on it from its first windows
    (the measurement still decides, and it was kept: it measured faster). Power check: without it
    the same candidate waits for a further window (``race_windows=1``)."""
    first_measured = {}
    for rush in (0.05, None):  # 0.05: every racer is far enough ahead (the tiny model copies little)
        cost = FixedCostModel(draft_full_s=0.0, verify_const_s=1.0)  # a copied token is free to draft
        sim = SimClock(verify=1.0, draft=0.0)
        ctx = SpaceContext(n_layers=N_LAYERS, max_draft_length=4)
        tuner = OnlineTuner(get_space("lookup"), ctx, optuna.create_study(direction="maximize"), cost,
                            TunerSettings(window=8, max_share=1.0, confirm_tokens=8, rush_margin=rush), clock=sim)
        decoder = Decoder(target, PromptLookupDrafter(max_ngram=3), 4, verify_width=5, kind="prompt-lookup")
        prompt = PROMPT * 3
        seen: list[int] = []

        def before_round(dec, tokens, cache, stats):
            sim.stats = stats
            tuner.before_round(dec, tokens, cache, stats)
            if tuner.challenger is not None and not seen:
                seen.append(tuner.state.windows)

        tuner.start_prompt(len(prompt))
        out = decoder.generate(prompt, GenerationConfig(max_new_tokens=64), before_round=before_round)
        tuner.end_prompt(prompt + out.tokens, out.stats)
        assert out.tokens == Decoder(target).generate(prompt, GenerationConfig(max_new_tokens=64)).tokens
        first_measured[rush] = seen[0] if seen else None
        if rush is not None:
            assert tuner.best.drafter == "prompt-lookup" and out.stats.drafted > 0
    assert first_measured[0.05] is not None and first_measured[None] == first_measured[0.05] + 1


def test_a_kind_whose_rushed_trial_lost_races_like_any_other(target):
    """Once a rushed trial (started on one window's price, ``rush_margin`` above the incumbent)
    lost, its drafter kind rushes no more against that incumbent: its next candidate, priced even
    further ahead, waits to win a fresh window (``race_windows``); other kinds still rush, and
    once the incumbent changes the kind rushes again. Power check: before the loss the same
    kind rushed at once."""
    from autotune.tuning.race import Race, Racer

    race = Race(switch_margin=0.05, race_windows=1, probation_tokens=128)
    race.incumbent.predicted_tps = 10.0  # plain decoding, 10 tokens/s
    decoder = Decoder(target, PromptLookupDrafter(max_ngram=3), 4, verify_width=9, kind="prompt-lookup")

    def racer(k: int, score: float, drafter: str = "prompt-lookup") -> Racer:
        r = Racer(Strategy(drafter=drafter, draft_length=k), trial=k, score=score, raw=score, matchness=0.5)
        race.race[r.strategy] = r
        return r

    first = racer(4, 20.0)
    assert race.rushes(first, 10.0, 0.25) and race.measure_best(decoder, [first], 10.0, 0.25)
    lost = race.challenger
    assert lost.rushed and decoder.kind == "prompt-lookup"
    lost.tokens, lost.seconds = 32, 8.0  # 4 tokens/s: slower than plain decoding
    race.challenger = None
    assert not race.decide(decoder, lost, None) and race.rush_lost == {"prompt-lookup"}
    assert race.summary()["rejected"][0]["rushed"] is True  # the study's JSON says which trials rushed
    second = racer(6, 40.0)
    assert not race.rushes(second, 10.0, 0.25) and not race.measure_best(decoder, [second], 10.0, 0.25)
    assert race.rushes(racer(3, 20.0, drafter="draft-model"), 10.0, 0.25)  # another kind still rushes
    second.wins = 1  # it won a fresh window: measured as any racer is
    assert race.measure_best(decoder, [second], 10.0, 0.25) and not race.challenger.rushed
    won = race.challenger
    won.tokens, won.seconds = 32, 1.0
    race.challenger = None
    assert race.decide(decoder, won, None) and not race.rush_lost  # a new incumbent: the kind may rush again
    assert race.rushes(racer(8, 80.0), 32.0, 0.25)


def test_a_survivor_pushed_out_of_the_race_by_joiners_is_not_measured(target):
    """A window's survivors are re-scored first, then the sweep's joiners enter; where the race is
    full, the worst-priced racer leaves it, a survivor that won its windows included. The measured
    trial goes to a racer still in the race, never to the one pushed out (a live re-tune failed on
    that, ``KeyError``, in a ``serve --adaptive`` replay). Power check: kept in the race, the same
    survivor is the one measured."""
    from autotune.tuning.race import RACE_SIZE, Race, Racer

    def build() -> tuple[Race, Racer]:
        race = Race(switch_margin=0.05, race_windows=1, probation_tokens=128)
        race.incumbent.predicted_tps = 10.0
        veteran = Racer(Strategy(drafter="prompt-lookup", draft_length=2), trial=0, score=11.0, raw=11.0,
                        matchness=0.5, wins=1)
        race.race[veteran.strategy] = veteran
        return race, veteran

    decoder = Decoder(target, PromptLookupDrafter(max_ngram=3), 4, verify_width=9, kind="prompt-lookup")
    race, veteran = build()
    for k in range(3, 3 + RACE_SIZE):  # better-priced joiners fill the race: the veteran is the worst
        assert race.join(Strategy(drafter="prompt-lookup", draft_length=k), k, 12.0 + k, 12.0 + k, 0.5, 10.0)
    assert veteran.strategy not in race.race and len(race.race) == RACE_SIZE
    assert not race.measure_best(decoder, [veteran], 10.0, None) and race.challenger is None
    race, veteran = build()
    assert race.measure_best(decoder, [veteran], 10.0, None) and race.challenger.strategy == veteran.strategy


def test_the_held_out_text_is_priced_by_the_cost_model_alone(target, draft):
    """``price_text`` prices a text the candidate just decoded: its replay knows what that text
    accepts, so the strategy's correction (which holds how far window forecasts of acceptance
    missed) is not applied again. Power check: a correction of 0.25 leaves the price unchanged."""
    from autotune.tuning.candidates import price_text

    decoder, tuner, _ = joint_tuner(target, draft)
    tokens = PROMPT * 4 + PROMPT[:5]
    new = len(tokens) - len(PROMPT)
    look = Strategy(drafter="prompt-lookup", draft_length=4)
    walked = predict_lookup_text(look, lookup_match(tokens, new, tuner.ctx.max_draft_length), tuner.cost)
    tuner.correction = lambda strategy: 0.25
    n, seconds = price_text(tuner, decoder, look, tokens, new)
    assert n == new and (n - 1) / seconds == pytest.approx(walked.tokens_per_s)
    assert walked.tokens_per_s > 1 / tuner.cost.plain_step_s()


@pytest.mark.parametrize("k", [2, 4, 6])
def test_a_whole_output_walked_gives_the_rounds_lookup_decoded(target, k):
    """Prompt lookup's price of a whole output (``lookup_walk``: the held-out text's price and the
    task's replay) walks the rounds that decoding it with prompt lookup ran: the same forwards,
    drafted and accepted tokens. Power check: the window replay (phases averaged over the
    positions a longer draft still fits) counts other rounds on the same text."""
    prompt = PROMPT + [7, 9, 61, 12] + PROMPT
    n = 48
    got = Decoder(target, PromptLookupDrafter(), k, verify_width=k + 1, kind="prompt-lookup").generate(
        prompt, GenerationConfig(max_new_tokens=n))
    assert got.tokens == Decoder(target).generate(prompt, GenerationConfig(max_new_tokens=n)).tokens
    stats, seq = got.stats, prompt + got.tokens
    assert stats.drafted > 0 and stats.accepted > 0 and len(got.tokens) == n
    match = lookup_match(seq, n, k)
    walked = lookup_walk(match, k)
    drafting = [(a, p) for a, p, _ in walked if p > 0]
    assert len(walked) + 1 == stats.target_forwards  # the prefill's forward gives the first token
    assert sum(p for _, p in drafting) == stats.drafted and sum(a for a, _ in drafting) == stats.accepted
    assert sum(a + 1 for a, _, _ in walked) == n - 1
    phased = lookup_rounds(match, k, 12)
    per_round = sum(w * (a + 1) for a, _, w in phased) / sum(w for _, _, w in phased)
    assert per_round != pytest.approx((n - 1) / len(walked))
