"""The held-out judgement of a study (``autotune.tuning.heldout``): the split is deterministic and
never tuned on, the stored strategy is the one that wins on prompts the tuner did not see, noise
does not decide, and prompt lookup is priced from how its context recurs."""
from __future__ import annotations

import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from autotune.tuning.cost_model import FixedCostModel
from autotune.tuning.heldout import (
    MIN_HELD, Candidate, choose, judge_on, lower_bound, plain_candidate, split_prompts, speedups,
)
from autotune.tuning.matchness import lookup_match
from autotune.tuning.objective import predict_lookup
from runtime.lookup import PromptLookupDrafter
from runtime.stats import DecodeStats
from search_spaces.strategy import PLAIN, Strategy

LOOKUP = Strategy(drafter="prompt-lookup", draft_length=12)
CHAIN = Strategy(drafter="draft-model", draft_length=4)


# ---------------------------------------------------------------------- the split
@given(st.integers(min_value=0, max_value=60))
def test_the_split_is_a_deterministic_partition(n):
    tuned, held = split_prompts(n)
    assert (tuned, held) == split_prompts(n)  # the same prompts every time
    assert sorted(tuned + held) == list(range(n)) and not set(tuned) & set(held)
    if n >= 2:
        assert tuned and held  # something to tune on, something to judge on
        assert {i for i in range(n) if i % 3 == 2} <= set(held)  # every third prompt
    if n >= MIN_HELD + 2:
        assert len(held) >= MIN_HELD and len(tuned) >= 2
    assert split_prompts(1) == ([0], [])


def test_the_demo_and_default_splits():
    assert split_prompts(3) == ([0, 1], [2])  # `make demo`: one held-out prompt (the table says it is weak)
    assert split_prompts(10) == ([0, 1, 3, 4, 6, 7, 9], [2, 5, 8])
    assert split_prompts(4) == ([0, 1], [2, 3])


# ---------------------------------------------------------------------- the choice
def stats(tps: float, tokens: int = 100) -> DecodeStats:
    return DecodeStats(new_tokens=tokens, wall_s=tokens / tps)


def scripted(speed: dict[tuple[Strategy, int], float], outputs: dict[Strategy, list[int]] | None = None):
    """A decode whose tokens/s per (strategy, prompt) is given: what the judgement decides on."""
    def decode(strategy: Strategy, ids: list[int]) -> tuple[list[int], DecodeStats]:
        out = (outputs or {}).get(strategy, [7, 8, 9])
        return out, stats(speed[strategy, ids[0]])
    return decode


def judged(prompts: list[int], speed, outputs=None) -> object:
    plain, a, b = plain_candidate(), Candidate(LOOKUP, "incumbent"), Candidate(CHAIN, "runner-up")
    judge_on([[p] for p in prompts], [plain, a, b], scripted(speed, outputs))
    return choose(plain, [a, b])


def test_the_held_out_winner_is_stored_not_the_in_sample_one():
    """Prompt lookup flies on the prompts tuned on (their completions copy the prompt) and loses on
    the others; the chain is steady. Judged on the held-out prompts the chain is stored; judged on
    the prompts tuned on (the held-out step removed) lookup would have been."""
    tuned, held = split_prompts(10)
    speed = {}
    for i in range(10):
        speed[PLAIN, i] = 10.0
        speed[LOOKUP, i] = 30.0 if i in tuned else 8.0
        speed[CHAIN, i] = 13.0
    verdict = judged(held, speed)
    assert verdict.chosen.strategy == CHAIN and "runner-up" in verdict.reason
    assert verdict.speedup == pytest.approx(1.3)
    assert judged(tuned, speed).chosen.strategy == LOOKUP  # power: in-sample, the wrong one wins


def test_a_candidate_whose_output_differed_is_never_chosen():
    held = [0, 1, 2]
    speed = {(s, i): v for i in held for s, v in ((PLAIN, 10.0), (LOOKUP, 30.0), (CHAIN, 9.0))}
    verdict = judged(held, speed, outputs={LOOKUP: [1, 2, 3]})
    assert verdict.chosen.strategy == PLAIN and "differed" in verdict.reason
    assert not verdict.candidates[1].identical and verdict.candidates[2].identical


def test_noise_does_not_decide_and_plain_wins_ties():
    held = list(range(4))
    # lookup: the higher mean, but it swings from prompt to prompt; the chain is a little slower and steady
    swings = [2.2, 0.8, 2.0, 0.7]
    speed = {}
    for i in held:
        speed[PLAIN, i], speed[LOOKUP, i], speed[CHAIN, i] = 10.0, 10.0 * swings[i], 12.5
    verdict = judged(held, speed)
    lookup, chain = verdict.candidates[1], verdict.candidates[2]
    assert sum(speedups(lookup, verdict.plain)) > sum(speedups(chain, verdict.plain))  # lookup's mean is higher
    assert verdict.chosen.strategy == CHAIN  # its lower bound is
    # within the noise of plain decoding: plain decoding is kept
    for i in held:
        speed[LOOKUP, i], speed[CHAIN, i] = 10.1, 9.9
    assert judged(held, speed).chosen.strategy == PLAIN
    assert lower_bound([1.01]) < 0 < lower_bound([1.2])
    assert lower_bound([]) == -math.inf


def test_the_order_rotates_prompt_by_prompt():
    seen = []

    def decode(strategy, ids):
        seen.append((ids[0], strategy))
        return [1], stats(10.0)

    cands = [plain_candidate(), Candidate(LOOKUP, "incumbent"), Candidate(CHAIN, "runner-up")]
    judge_on([[0], [1], [2]], cands, decode)
    firsts = [s for i, s in seen[::3]]
    assert firsts == [PLAIN, LOOKUP, CHAIN]  # each candidate goes first once
    assert all(len(c.runs) == 3 for c in cands)


# ---------------------------------------------------------------------- pricing prompt lookup
def recurring_text(rate: float, n_segments: int = 80, seed: int = 0, seg: int = 12) -> list[int]:
    """Segments of ``seg`` tokens: with probability ``rate`` a copy of an earlier segment, else
    fresh tokens (never seen before)."""
    rng = random.Random(seed)
    segments: list[list[int]] = []
    fresh = 1000
    for _ in range(n_segments):
        if segments and rng.random() < rate:
            segments.append(list(rng.choice(segments)))
        else:
            segments.append(list(range(fresh, fresh + seg)))
            fresh += seg
    return [t for seg in segments for t in seg]


def decoded_rounds(tokens: list[int], start: int, k: int) -> tuple[int, int]:
    """Greedy prompt-lookup decoding of ``tokens[start:]`` (the target's tokens are the text's):
    -> (tokens decoded, rounds)."""
    drafter = PromptLookupDrafter()
    drafter.begin(tokens[:start], 0)
    i, rounds = start, 0
    while i < len(tokens):
        at = drafter.match(k)
        guess = drafter.history[at: at + k] if at is not None else []
        a = 0
        while a < len(guess) and i + a < len(tokens) and guess[a] == tokens[i + a]:
            a += 1
        new = tokens[i: i + a + 1]
        drafter.observe(a, new)
        i += len(new)
        rounds += 1
    return len(tokens) - start, rounds


@pytest.mark.parametrize("rate", [0.2, 0.5, 0.8])
def test_lookup_pricing_tracks_how_often_the_context_recurs(rate):
    """Tokens per round predicted from the text's own match statistics against lookup decoding the
    same text, round by round (one verify = one plain step here, so tokens/s is tokens per
    round): within 10% at every recurrence rate, rising with it. Power: averaging the window's
    positions (every position a round start, the earlier rule) misses by more than 15% where
    half the text recurs or more."""
    tokens = recurring_text(rate)
    start = 240
    window = len(tokens) - start
    match = lookup_match(tokens, window, 12)
    cost = FixedCostModel(draft_full_s=0.0, verify_const_s=1.0)
    predicted = predict_lookup(LOOKUP, match, cost).tokens_per_round
    made, rounds = decoded_rounds(tokens, start, 12)
    measured = made / rounds
    assert predicted == pytest.approx(measured, rel=0.10)
    per_position = 1.0 + sum(min(a, 12) for a in match.accepted) / match.window
    if rate >= 0.5:
        assert abs(per_position / measured - 1.0) > 0.15


def test_lookup_pricing_rises_with_recurrence_and_pays_for_its_rows():
    cost = FixedCostModel(draft_full_s=0.0, verify_const_s=1.0)
    by_rate = []
    for rate in (0.1, 0.4, 0.7, 0.95):
        tokens = recurring_text(rate, seed=1)
        by_rate.append(predict_lookup(LOOKUP, lookup_match(tokens, 600, 12), cost).tokens_per_s)
    assert by_rate == sorted(by_rate) and by_rate[-1] > 3 * by_rate[0]
    # a verify that runs only its drafted rows (a quantised target) costs more per row: priced so
    tokens = recurring_text(0.5, seed=1)
    match = lookup_match(tokens, 600, 12)
    per_row = FixedCostModel(draft_full_s=0.0, verify_const_s=1.0, verify_row_s=0.25)
    assert predict_lookup(LOOKUP, match, per_row).tokens_per_s < predict_lookup(LOOKUP, match, cost).tokens_per_s


def test_the_lookup_runner_up_is_priced_over_every_tuned_output():
    """The lookup length stored for the held-out check is the one predicted fastest over all the
    text decoded while tuning: where copies run 4 tokens, the longest where a verify costs the
    same at any width (padded), a shorter one where every row costs (a quantised target's verify
    runs its own rows)."""
    import optuna

    from autotune.tuning.candidates import best_lookup
    from autotune.tuning.tuner import OnlineTuner, TunerSettings
    from search_spaces.spaces import SpaceContext, get_space

    space, ctx = get_space("lookup"), SpaceContext(n_layers=4, max_draft_length=12)
    text = recurring_text(0.5, n_segments=200, seed=3, seg=4)
    picks = {}
    for name, cost in (("flat", FixedCostModel(draft_full_s=0.0, verify_const_s=1.0)),
                       ("per row", FixedCostModel(draft_full_s=0.0, verify_const_s=1.0, verify_row_s=0.4))):
        tuner = OnlineTuner(space, ctx, optuna.create_study(direction="maximize"), cost, TunerSettings())
        tuner.decoded = [(200, text[:500]), (100, text[500:])]
        seed = Strategy(drafter="prompt-lookup", draft_length=12)
        picks[name] = best_lookup(tuner, space, ctx, (seed, 1.0))
        assert picks[name][1] == max(tuner.task_tps(s) or 0 for s in space.sweep(seed, ctx))
    assert picks["flat"][0].draft_length >= 10  # copies of up to 12 tokens are free to verify
    assert picks["per row"][0].draft_length < picks["flat"][0].draft_length


def test_the_stated_interval_holds_the_speedup_and_widens_with_spread_and_few_prompts():
    """The stored speed-up's interval is centred on it, holds it, is wider where the prompts
    disagree and where they are few (Student's t), and says what it rests on. Power check: a
    steady candidate's interval is narrow enough to exclude 1."""
    from autotune.tuning.heldout import interval, rests_on

    steady = {(s, i): v for i in range(6) for s, v in ((PLAIN, 10.0), (LOOKUP, 13.0), (CHAIN, 12.0))}
    verdict = judged(list(range(6)), steady)
    lo, hi = verdict.interval
    assert lo < verdict.speedup < hi and lo > 1.0  # 1.3x on every prompt: 1 is outside
    swinging = dict(steady)
    for i, f in enumerate([2.2, 0.8, 2.0, 0.7, 1.9, 0.9]):
        swinging[LOOKUP, i] = 10.0 * f
    wide = judged(list(range(6)), swinging)
    lk = wide.candidates[1]
    lo2, hi2 = interval(lk, wide.plain)
    assert lo2 < 1.0 < hi2 and hi2 / lo2 > hi / lo
    few = judged([0, 1, 2], swinging)
    lo3, hi3 = interval(few.candidates[1], few.plain)
    assert hi3 / lo3 > hi2 / lo2  # three prompts: a wider interval than six
    assert "fewer than" in rests_on(few) and "fewer than" not in rests_on(verdict)
    assert interval(judged([0], steady).candidates[1], judged([0], steady).plain) is None
    d = verdict.as_dict()
    assert d["interval"] == [lo, hi] and "6 held-out prompt(s)" in d["rests_on"]
