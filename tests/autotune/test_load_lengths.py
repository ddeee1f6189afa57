"""Load-aware draft lengths (``autotune.tuning.load``): the goodput choice shrinks drafts as the
batch grows, drops speculation that does not pay, and the step cost fits what it observes."""
from __future__ import annotations

import pytest

from autotune.tuning.load import STEPS_KEPT, Candidate, RouteAcceptance, StepCost, acceptance_estimate, choose_lengths, \
    expected_tokens, pays_alone, starts_alone


def _cpu_like() -> StepCost:
    """A step that costs 100 ms plus 3 ms a row and 1 ms a sequence (a CPU's nearly flat verify)."""
    return StepCost([(r, s, 0.1 + 0.003 * r + 0.001 * s) for r in (1, 4, 16, 64) for s in (1, 4, 16) if s <= r])


def test_step_cost_recovers_its_coefficients():
    cost = _cpu_like()
    assert cost.predict(10, 2) == pytest.approx(0.1 + 0.03 + 0.002, rel=1e-6)


def _flat_then_linear(rows: int, seqs: int) -> float:
    """A oneDNN-like step: 160 ms up to 8 rows, then 7 ms a row, and 4 ms each further sequence."""
    return 0.16 + 0.007 * max(rows - 8, 0) + 0.004 * (seqs - 1)


def test_step_cost_follows_a_flat_start_and_a_price_per_sequence():
    """The start-up profile's shapes (``step_shapes``) of a step that is flat for its first rows:
    the fit prices a lone step, the rows in between the profiled ones and the sequences as they
    are (a line through the same points priced the lone step 16% low), and extrapolates past the
    last profiled row count along its last segment."""
    from autotune.measure.steps import step_shapes

    cost = StepCost([(r, s, _flat_then_linear(r, s)) for r, s in step_shapes(16)])
    for rows, seqs in [(1, 1), (3, 1), (6, 2), (12, 4), (16, 16), (30, 8), (80, 16), (120, 16)]:
        assert cost.predict(rows, seqs) == pytest.approx(_flat_then_linear(rows, seqs), rel=1e-6), (rows, seqs)


def test_step_cost_never_falls_with_rows_and_learns_from_real_steps():
    """Noisy timings give a fit that still rises with rows; steps observed on a slower machine
    (twice the profile's times) move the prediction to them once refitted (every 16 steps)."""
    import random

    rng = random.Random(0)
    noisy = [(r, s, _flat_then_linear(r, s) * rng.uniform(0.85, 1.15)) for r in (1, 2, 4, 8, 16, 32) for s in (1, 2, 4)
             if s <= r]
    cost = StepCost(noisy)
    by_rows = [cost.predict(r, 2) for r in range(1, 64)]
    assert all(b >= a - 1e-12 for a, b in zip(by_rows, by_rows[1:]))
    assert cost.per_seq >= 0
    before = cost.predict(16, 4)
    for _ in range(STEPS_KEPT):
        cost.observe(16, 4, 2 * _flat_then_linear(16, 4))
    assert before < 1.2 * _flat_then_linear(16, 4)
    assert cost.predict(16, 4) == pytest.approx(2 * _flat_then_linear(16, 4), rel=0.1)


def test_a_small_batch_fills_the_rows_a_flat_step_gives_for_free():
    """Rows free up to 16, then 20 ms each: four sequences with free drafts at acceptance 0.9 draft
    3 tokens each (4 x 4 = 16 rows) and no more."""
    cost = StepCost([(r, s, 0.1 + 0.02 * max(r - 16, 0)) for r in (1, 4, 16, 32, 64) for s in (1, 4) if s <= r])
    assert choose_lengths([Candidate(0.9, 8, 0.0)] * 4, cost) == [3, 3, 3, 3]


def test_the_best_draft_length_falls_as_the_batch_grows():
    cost = _cpu_like()
    seq = Candidate(acceptance=0.8, max_length=8, draft_token_s=0.002)
    by_batch = {b: choose_lengths([seq] * b, cost) for b in (1, 4, 16, 64)}
    mean = {b: sum(ks) / len(ks) for b, ks in by_batch.items()}
    assert mean[1] >= mean[4] >= mean[16] >= mean[64]
    assert mean[1] > mean[64]
    assert all(k <= 8 for ks in by_batch.values() for k in ks)


def test_speculation_that_does_not_pay_is_dropped():
    cost = _cpu_like()
    slow_draft = Candidate(acceptance=0.2, max_length=6, draft_token_s=0.05)  # a draft token costs half a step
    assert choose_lengths([slow_draft], cost) == [0]
    lookup = Candidate(acceptance=0.7, max_length=6, draft_token_s=0.0)
    assert choose_lengths([lookup], cost)[0] > 0


def test_choice_maximises_goodput_against_brute_force():
    cost = _cpu_like()
    cands = [Candidate(0.9, 5, 0.001), Candidate(0.5, 5, 0.004), Candidate(0.7, 3, 0.0)]

    def goodput(ks):
        rows = sum(1 + k for k in ks)
        seconds = cost.predict(rows, 3) + sum(c.draft_token_s * k for c, k in zip(cands, ks))
        return sum(expected_tokens(c.acceptance, k) for c, k in zip(cands, ks)) / seconds

    best = max(((a, b, c) for a in range(6) for b in range(6) for c in range(4)), key=goodput)
    got = choose_lengths(cands, cost)
    assert goodput(got) == pytest.approx(goodput(list(best)), rel=1e-9)


def test_a_catch_up_near_the_end_of_a_request_does_not_pay():
    """A draft model that has yet to catch up (0.5 s here, five plain steps) drafts where many
    tokens are left and not where a few are, alone or in a batch; paid (0), it drafts either way."""
    cost = _cpu_like()
    fresh = dict(acceptance=0.8, max_length=6, draft_token_s=0.002, start_s=0.5)
    many, few = Candidate(**fresh, remaining=200), Candidate(**fresh, remaining=4)
    assert starts_alone(many, cost) and not starts_alone(few, cost)
    assert starts_alone(Candidate(0.8, 6, 0.002, remaining=4), cost)  # nothing to catch up on
    # alone, a draft the step cost would not pick still runs (its tuned strategy), catch-up or not
    slow = Candidate(acceptance=0.2, max_length=6, draft_token_s=0.05, start_s=0.05, remaining=200)
    assert choose_lengths([slow], cost) == [0] and starts_alone(slow, cost)
    assert choose_lengths([many, many], cost)[0] > 0
    assert choose_lengths([few, few], cost) == [0, 0]
    assert choose_lengths([Candidate(0.8, 6, 0.002, remaining=4)] * 2, cost)[0] > 0


def test_acceptance_estimate_moves_from_the_prior_to_the_sequence():
    assert acceptance_estimate(0.9, 0, 0) == pytest.approx(0.9)
    assert acceptance_estimate(0.9, 10, 100) < 0.2
    assert acceptance_estimate(None, 0, 0) == pytest.approx(0.6)


def test_a_routes_live_acceptance_weighs_its_requests_by_what_they_drafted():
    """An exponentially weighted ratio of accepted to drafted tokens per (route, strategy): none
    until ``min_drafts`` tokens were drafted, a request that drafted little moves it little, and
    the figures are kept apart by route and by strategy."""
    from search_spaces.strategy import Strategy

    lookup, chain = Strategy(drafter="prompt-lookup", draft_length=5), Strategy(drafter="draft-model", draft_length=4)
    live = RouteAcceptance(weight=0.3, min_drafts=8)
    live.observe("xsum", lookup, 2, 5)
    assert live.get("xsum", lookup) is None  # 5 drafts: the stored figure still stands
    live.observe("xsum", lookup, 0, 0)  # a request that drafted nothing says nothing
    live.observe("xsum", lookup, 36, 40)
    assert live.get("xsum", lookup) == pytest.approx((0.7 * 0.3 * 2 + 0.3 * 36) / (0.7 * 0.3 * 5 + 0.3 * 40))
    live.observe("xsum", lookup, 0, 2)  # a short miss barely moves a figure of 40 drafts
    assert 0.8 < live.get("xsum", lookup) < 0.9
    assert live.get("gsm8k", lookup) is None and live.get("xsum", chain) is None
    assert list(live.describe()) == ["xsum"] and list(live.describe()["xsum"]) == [lookup.to_json()]
    bounded = RouteAcceptance(max_keys=2)
    for route in ("a", "b", "c"):
        bounded.observe(route, chain, 10, 10)
    assert bounded.get("a", chain) is None and bounded.get("c", chain) == 1.0


def test_a_sequence_starts_from_its_routes_live_acceptance_over_the_stored_one():
    """``planner.candidate``: the route's live figure for the strategy a sequence runs, once
    there is one; until then the stored strategy's acceptance."""
    from types import SimpleNamespace

    from autotune.serving.costs import CostFigures
    from autotune.serving.planner import candidate
    from runtime.stats import DecodeStats
    from search_spaces.strategy import Strategy

    lookup = Strategy(drafter="prompt-lookup", draft_length=5)
    seq = SimpleNamespace(stats=DecodeStats(), prompt=[1] * 10, out=[], config=SimpleNamespace(max_new_tokens=64))
    job = SimpleNamespace(choice=SimpleNamespace(entry=SimpleNamespace(acceptance=0.16), route="xsum", state="stored"))
    r = SimpleNamespace(current=lookup, member=SimpleNamespace(seq=seq, decoder=None), job=job, drafter_synced=True)
    figures = CostFigures(step_cost=_cpu_like(), acceptance=RouteAcceptance())
    assert candidate(r, figures).acceptance == pytest.approx(0.16)
    figures.acceptance.observe("xsum", lookup, 30, 40)
    assert candidate(r, figures).acceptance == pytest.approx(0.75)


def test_a_row_budget_caps_the_step():
    cost = StepCost([(r, s, 0.1 + 0.0001 * r) for r in (1, 8, 32) for s in (1, 4) if s <= r])  # rows nearly free
    seqs = [Candidate(0.9, 8, 0.0)] * 4
    assert choose_lengths(seqs, cost) == [8, 8, 8, 8]
    capped = choose_lengths(seqs, cost, max_rows=12)
    assert sum(1 + k for k in capped) == 12 and max(capped) - min(capped) <= 1
    assert choose_lengths(seqs, cost, max_rows=4) == [0, 0, 0, 0]


def test_batch_schedule_is_vllm_ranges_that_shrink_with_the_batch():
    from autotune.tuning.load import batch_schedule

    cost = _cpu_like()
    schedule = batch_schedule(0.8, 8, cost, draft_step_s=lambda b: 0.01 + 0.0005 * b)
    ranges = [tuple(map(int, key.split("-"))) for key in schedule]
    assert ranges[0][0] == 1 and ranges[-1][1] == 64
    assert all(hi + 1 == lo for (_, hi), (lo, _) in zip(ranges, ranges[1:]))  # contiguous, inclusive
    ks = list(schedule.values())
    assert ks == sorted(ks, reverse=True) and ks[0] > ks[-1] and ks[0] <= 8
    assert len(set(ks)) == len(ks)  # equal neighbours merged


def test_a_tree_narrows_before_it_shortens_as_the_batch_grows():
    """A (3, 2, 1) tree's options include every narrower tree down to a chain; alone it keeps its
    whole tree where rows are nearly free, and a batch of 16 drafts narrower (fewer rows per depth)
    before it stops drafting."""
    from autotune.tuning.load import choose_shapes

    tree = Candidate(acceptance=0.6, max_length=3, draft_token_s=0.001, widths=(3, 2, 1))
    shapes = tree.shapes()
    assert [s.rows for s in shapes] == sorted(s.rows for s in shapes)
    assert all(b.tokens > a.tokens for a, b in zip(shapes, shapes[1:]))  # each option buys tokens
    chain3 = next(s for s in shapes if s.length == 3 and s.width == 1)
    assert chain3.rows == 4 and chain3.tokens == pytest.approx(expected_tokens(0.6, 3))
    assert shapes[-1].width is None and shapes[-1].rows == 1 + 3 + 6 + 6
    flat = StepCost([(r, s, 0.1 + 0.0001 * r) for r in (1, 8, 64) for s in (1, 4, 16) if s <= r])
    assert choose_shapes([tree], flat)[0].width is None  # rows nearly free: the whole tree
    busy = choose_shapes([tree] * 16, _cpu_like())
    assert all(s.width is not None for s in busy)  # 3 ms a row: every tree is narrower
    assert any(s.length > 0 for s in busy)  # but the batch still drafts


def test_a_strategy_pays_alone_where_its_round_beats_plain_steps():
    """A chain of 10 at acceptance 0.6 appends 2.49 tokens a round: it pays where its round (10
    drafts and a verify) costs less than 2.49 plain steps, as a float32 1.5B target with an int4
    draft does on a 2-core CPU (16 ms a draft, 193 ms a verify, 162 ms a plain step) and an int4
    target does not (plain 38 ms, verify 149 ms)."""
    chain = Candidate(0.6, 10, 0.016)
    assert pays_alone(chain, lambda rows: 0.193, 0.162)
    assert not pays_alone(chain, lambda rows: 0.149, 0.038)
    # a verify of 0.25 s: the whole chain (2.49 tokens, 0.40 s of plain steps, for 0.41 s) no longer
    # pays, while a confidence-aware chain, judged at its best length (3: 2.18 tokens for 0.298 s), does
    assert not pays_alone(chain, lambda rows: 0.25, 0.162)
    assert pays_alone(chain, lambda rows: 0.25, 0.162, stops_early=True)
    assert not pays_alone(chain, lambda rows: 0.149, 0.038, stops_early=True)
    rows_seen = []
    assert pays_alone(Candidate(0.6, 4, 0.0, widths=(2, 2)), lambda rows: rows_seen.append(rows) or 0.1, 0.1)
    assert rows_seen == [1 + 2 + 4]  # a tree is priced at its whole draft's rows (two depths here)
    assert not pays_alone(Candidate(0.9, 0, 0.0), lambda rows: 0.0, 1.0)  # plain decoding never "pays"
    # a margin: the whole chain's 2.49 tokens for 0.353 s of rounds beat 0.403 s of plain steps by 14%
    assert pays_alone(chain, lambda rows: 0.193, 0.162, margin=0.1)
    assert not pays_alone(chain, lambda rows: 0.193, 0.162, margin=0.15)


def test_a_catch_up_is_priced_as_a_forward_with_a_price_of_its_own():
    """Catch-ups of 20 ms + 0.1 ms a token: after a short one and a long one the price of any length
    is right, where a rate per token from the short one priced a 1000-token prompt at 1.1 s (0.12)."""
    from autotune.tuning.load import CatchUpCost

    cost = CatchUpCost()
    assert cost.predict(500) == 0.0  # nothing seen: nothing priced
    cost.observe(20, 0.022)
    assert cost.predict(1000) == pytest.approx(1.1)  # one length seen: its rate
    cost.observe(400, 0.06)
    assert cost.predict(1000) == pytest.approx(0.12) and cost.predict(100) == pytest.approx(0.03)
    for _ in range(64):  # only the latest catch-ups count
        cost.observe(100, 0.5)
        cost.observe(300, 1.5)
    assert cost.predict(200) == pytest.approx(1.0)


def test_a_strategys_candidate_has_its_length_rows_and_widths():
    """``Candidate.of``: what the goodput choice and the unknown-traffic start both read off a strategy."""
    from search_spaces.strategy import PLAIN, Strategy

    tree = Candidate.of(Strategy(drafter="draft-model", draft_length=3, tree_widths=(2, 2, 1)), 0.7, 0.01,
                        start_s=0.2, remaining=40)
    assert (tree.max_length, tree.widths, tree.rows(2), tree.rows(3), tree.start_s, tree.remaining) == \
        (3, (2, 2, 1), 1 + 2 + 4, 1 + 2 + 4 + 4, 0.2, 40)
    chain = Candidate.of(Strategy(drafter="prompt-lookup", draft_length=5), 0.4, 0.0)
    assert (chain.max_length, chain.widths, chain.rows(5)) == (5, (), 6)
    plain = Candidate.of(PLAIN, 0.9, 0.0)
    assert (plain.max_length, plain.widths, [s.length for s in plain.shapes()]) == (0, (), [0])


def test_a_draft_models_depth_forward_is_priced_once_and_per_sequence():
    """``DraftCost``: a depth forward of m sequences costs ``fixed + per_seq * m``; one batch size
    cannot tell the two apart (not known); real drafting phases (depths, drafts) move the fit."""
    from autotune.tuning.load import DraftCost

    cost = DraftCost([(m, 0.012 + 0.004 * m) for m in (1, 2, 4, 8, 16)])
    assert cost.known and cost.fixed == pytest.approx(0.012) and cost.per_seq == pytest.approx(0.004)
    assert cost.forward_s(4) == pytest.approx(0.028)
    assert not DraftCost([(1, 0.016)]).known
    lone = DraftCost([(1, 0.016)])
    lone.observe(3, 3, 0.048)  # alone again: still one size
    assert not lone.known
    lone.observe(2, 8, 2 * 0.012 + 8 * 0.004)  # two depths for four sequences
    assert lone.known and lone.forward_s(4) < 4 * lone.forward_s(1)
    for _ in range(64):
        cost.observe(3, 12, 3 * 0.012 + 12 * 0.006)  # real phases of 4 sequences: 36 ms a depth, not 28
    assert 0.034 < cost.forward_s(4) <= 0.036 + 1e-9
    cost.observe(0, 0, 1.0)  # nothing drafted: not a phase
    assert all(d >= 1 for d, _, _ in cost.steps)


def test_a_batch_drafts_where_its_shared_depth_forward_pays_though_one_sequence_alone_would_not():
    """On a flat 100 ms step, a depth forward of 20 ms plus 1 ms a sequence: one sequence's first
    draft token does not pay for a whole forward (4.6 tokens in 121 ms against 4 in 100), four
    together do (6.4 in 124 ms). Priced per sequence (21 ms each, no group) the batch drafts nothing;
    as a group, every sequence drafts."""
    from autotune.tuning.load import choose_shapes

    flat = StepCost([(r, s, 0.1) for r in (1, 8, 64) for s in (1, 4, 16) if s <= r])
    shared = [Candidate(0.6, 4, 0.001, draft_fixed_s=0.02, draft_group="draft-model")] * 4
    assert all(s.length >= 1 for s in choose_shapes(shared, flat))
    apart = [Candidate(0.6, 4, 0.021)] * 4
    assert [s.length for s in choose_shapes(apart, flat)] == [0, 0, 0, 0]
    # a candidate outside the group pays its own forwards: the lookup beside them is unaffected
    mixed = shared[:3] + [Candidate(0.6, 4, 0.0)]
    got = choose_shapes(mixed, flat)
    assert all(s.length >= 1 for s in got)


def test_the_shared_price_choice_against_brute_force():
    """Two draft-model sequences sharing their depth forwards and a prompt lookup: the choice
    reaches the best goodput of every combination of lengths."""
    cost = _cpu_like()
    cands = [Candidate(0.85, 4, 0.002, draft_fixed_s=0.012, draft_group="d"),
             Candidate(0.6, 4, 0.002, draft_fixed_s=0.012, draft_group="d"), Candidate(0.5, 3, 0.0)]

    def goodput(ks):
        rows = sum(1 + k for k in ks)
        seconds = cost.predict(rows, 3) + 0.002 * (ks[0] + ks[1]) + 0.012 * max(ks[0], ks[1])
        return sum(expected_tokens(c.acceptance, k) for c, k in zip(cands, ks)) / seconds

    best = max(((a, b, c) for a in range(5) for b in range(5) for c in range(4)), key=goodput)
    assert goodput(choose_lengths(cands, cost)) == pytest.approx(goodput(list(best)), rel=1e-9)


def test_a_step_is_recorded_as_a_draft_models_phase_only_where_every_drafter_ran_its_chains():
    """``CostFigures.observe_drafting``: two chains of one draft model's weights are a phase
    (depths: the longer chain); a prompt-lookup copy beside them (free, though its decoder holds the
    draft model on standby), a tree, or a second draft model's chain is not."""
    from types import SimpleNamespace

    from autotune.serving.costs import CostFigures, draft_key
    from search_spaces.strategy import PLAIN, Strategy

    weights = SimpleNamespace(linears=object(), head=object())
    other = SimpleNamespace(linears=object(), head=object())

    def running(strategy, model=weights):
        drafter = SimpleNamespace(model=model)
        decoder = SimpleNamespace(drafter_of=lambda kind: drafter if kind == "draft-model" else None)
        return SimpleNamespace(current=strategy, member=SimpleNamespace(decoder=decoder))

    chain = Strategy(drafter="draft-model", draft_length=4)
    a, b = running(chain), running(chain)
    figures = CostFigures()
    figures.observe_drafting([a, b, running(PLAIN)], [3, 2, 0], 0.05)
    key = draft_key(a.member.decoder)
    assert list(figures.draft_costs) == [key] and list(figures.draft_costs[key].steps) == [(3, 5, 0.05)]
    for mate in (running(Strategy(drafter="prompt-lookup", draft_length=4)),
                 running(Strategy(drafter="draft-model", draft_length=3, tree_widths=(2, 2, 1))),
                 running(chain, other)):
        figures.observe_drafting([a, mate], [3, 2], 0.05)
    assert list(figures.draft_costs[key].steps) == [(3, 5, 0.05)] and len(figures.draft_costs) == 1
