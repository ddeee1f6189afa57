"""The decode worker's step planner (``autotune.serving.planner``): from the running batch and the
cost figures to each request's draft length and tree width this step, with no thread and no model."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest

from autotune.serving.costs import CostFigures
from autotune.serving.planner import DRAFT_TOKEN_SHARE, StepShape, candidate, fit_rows, plan_step
from autotune.tuning.load import CatchUpCost, RouteAcceptance, StepCost, choose_shapes
from runtime.stats import DecodeStats
from search_spaces.strategy import PLAIN, Strategy

CHAIN = Strategy(drafter="prompt-lookup", draft_length=6)
TREE = Strategy(drafter="draft-model", draft_length=3, tree_widths=(2, 2, 1))


def _figures(**kw) -> CostFigures:
    """A step of 100 ms plus 3 ms a row and 1 ms a sequence (a CPU's nearly flat verify)."""
    cost = StepCost([(r, s, 0.1 + 0.003 * r + 0.001 * s) for r in (1, 4, 16, 64) for s in (1, 4, 16) if s <= r])
    return CostFigures(step_cost=cost, **kw)


def _running(strategy: Strategy, acceptance: float | None = 0.8, out: int = 0, max_new: int = 64,
             synced: bool = True, route: str = "gsm8k", cached: int = 0) -> SimpleNamespace:
    """What the planner reads of a running request: its strategy, sequence, choice and decoder (whose
    drafting model has run nothing of the sequence but the ``cached`` rows a prefix cache gave it)."""
    seq = SimpleNamespace(stats=DecodeStats(), prompt=[1] * 40, out=[2] * out,
                          config=SimpleNamespace(max_new_tokens=max_new))
    entry = SimpleNamespace(acceptance=acceptance) if acceptance is not None else None
    job = SimpleNamespace(choice=SimpleNamespace(entry=entry, route=route, state="stored"))
    decoder = SimpleNamespace(drafter_of=lambda kind: None, step_cap="untouched", step_width="untouched",
                              catch_up_rows=lambda: 40 + out - cached)
    return SimpleNamespace(current=strategy, member=SimpleNamespace(seq=seq, decoder=decoder), job=job,
                           drafter_synced=synced)


def test_fit_rows_caps_a_draft_to_the_steps_row_budget():
    assert fit_rows(CHAIN, None) is None and fit_rows(PLAIN, 2) is None
    assert fit_rows(CHAIN, 7) is None  # 1 + 6 rows fit
    assert fit_rows(CHAIN, 4) == 3
    assert fit_rows(TREE, 100) is None and fit_rows(TREE, 1) == 0


def test_without_load_awareness_each_request_drafts_its_strategys_length_within_the_row_budget():
    batch = [_running(CHAIN), _running(PLAIN), _running(TREE)]
    assert plan_step(batch, _figures(), None, load_aware=False) == [StepShape(None)] * 3
    assert plan_step(batch, _figures(), 4, load_aware=False) == [StepShape(3), StepShape(None), StepShape(fit_rows(TREE, 4))]


def test_a_lone_request_runs_its_strategy_unless_its_catch_up_cannot_pay_back():
    figures = _figures()
    assert plan_step([_running(CHAIN)], figures, None, load_aware=True) == [StepShape(None)]
    assert plan_step([_running(CHAIN)], figures, 4, load_aware=True) == [StepShape(3)]
    figures.catch_ups["prompt-lookup"] = CatchUpCost()
    figures.catch_ups["prompt-lookup"].observe(40, 60.0)  # a minute to catch up on 40 tokens
    unsynced = _running(CHAIN, synced=False, out=60)  # 4 tokens left
    assert plan_step([unsynced], figures, None, load_aware=True) == [StepShape(0)]
    assert plan_step([_running(CHAIN, out=60)], figures, None, load_aware=True) == [StepShape(None)]  # caught up


def test_a_catch_up_is_priced_on_the_rows_a_prefix_cache_left_to_run():
    figures = _figures()
    figures.catch_ups["prompt-lookup"] = CatchUpCost()
    figures.catch_ups["prompt-lookup"].observe(40, 8.0)  # 0.2 s a token: 40 cost more than 64 plain steps
    assert plan_step([_running(CHAIN, synced=False)], figures, None, load_aware=True) == [StepShape(0)]
    cached = _running(CHAIN, synced=False, cached=38)  # the cache gave the drafting model all but 2 rows
    assert plan_step([cached], figures, None, load_aware=True) == [StepShape(None)]


def test_a_batch_gets_the_goodput_choice_of_its_candidates():
    figures = _figures()
    batch = [_running(CHAIN, 0.9), _running(CHAIN, 0.1), _running(PLAIN)]
    want = choose_shapes([candidate(r, figures) for r in batch], figures.step_cost, 12)
    got = plan_step(batch, figures, 12, load_aware=True)
    assert got == [StepShape(s.length, s.width) for s in want]
    assert got[2] == StepShape(0, want[2].width) and got[0].length >= got[1].length


def test_planning_changes_neither_the_batch_nor_the_figures():
    figures = _figures()
    figures.acceptance.observe("gsm8k", CHAIN, 30, 40)
    batch = [_running(CHAIN), _running(TREE, synced=False)]
    before = (copy.deepcopy(figures.acceptance.describe()), dict(figures.draft_token_s), dict(figures.catch_ups))
    for load_aware in (True, False):
        plan_step(batch, figures, 8, load_aware)
    assert (figures.acceptance.describe(), figures.draft_token_s, figures.catch_ups) == before
    assert all(r.member.decoder.step_cap == "untouched" == r.member.decoder.step_width for r in batch)


def test_a_candidate_prices_its_drafting_from_what_was_measured_first():
    figures = _figures(acceptance=RouteAcceptance(min_drafts=1))
    r = _running(CHAIN, acceptance=None)
    assert candidate(r, figures).draft_token_s == pytest.approx(DRAFT_TOKEN_SHARE * figures.step_cost.predict(1, 1))
    figures.draft_token_s["prompt-lookup"] = 0.002  # what the last request of this drafter measured
    assert candidate(r, figures).draft_token_s == 0.002
    r.member.seq.stats.draft_s, r.member.seq.stats.drafted = 0.01, 20  # its own drafting, once it has drafted
    assert candidate(r, figures).draft_token_s == pytest.approx(0.0005)
    figures.acceptance.observe("gsm8k", CHAIN, 9, 10)  # the route's live figure, over a stored 0.2
    live, stored = _running(CHAIN, acceptance=0.2), _running(CHAIN, acceptance=0.2, route="xsum")
    assert candidate(live, figures).acceptance > candidate(stored, figures).acceptance


def test_a_finished_requests_acceptance_counts_where_one_strategy_did_all_its_drafting():
    """A request's acceptance teaches its route (and its cluster's key) when one speculative
    strategy drafted all its tokens: uncontrolled, controlled without switches, or switched only to
    plain decoding since; not after a switch to another draft."""
    from autotune.tuning.controller import Decision

    chain = Strategy(drafter="draft-model", draft_length=4)
    look = Strategy(drafter="prompt-lookup", draft_length=8)

    def finished(current: Strategy, start: Strategy | None, path: list[str]) -> SimpleNamespace:
        stats = DecodeStats(new_tokens=20, drafted=16, accepted=4, draft_s=0.16)
        control = None if start is None else SimpleNamespace(
            started_with=start, current=current, decisions=[Decision(8 * i, {}, c, True, "predicted")
                                                             for i, c in enumerate(path)])
        return SimpleNamespace(member=SimpleNamespace(seq=SimpleNamespace(stats=stats)), control=control,
                               current=current)

    cases = {"uncontrolled": (finished(chain, None, []), True), "kept": (finished(chain, chain, []), True),
             "to plain": (finished(PLAIN, chain, ["plain"]), True),
             "to lookup": (finished(look, chain, ["lookup-8"]), False),
             "started plainly": (finished(PLAIN, PLAIN, []), False)}
    for name, (r, counts) in cases.items():
        figures = CostFigures(acceptance=RouteAcceptance(min_drafts=1))
        figures.observe_finished(["unknown", "unknown#3"], r)
        assert (figures.acceptance.get("unknown#3", chain) == 0.25) == counts, name
