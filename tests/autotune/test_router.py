"""The task router: TF-IDF nearest centroid with a distance threshold, and its measured default on
real task prompts (HumanEval, GSM8K, MT-Bench; no models)."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from autotune.serving.routing.router import DEFAULT_ROUTE_DISTANCE, MIN_REACH, REACH_SLACK, UNKNOWN, RouteDecision, RouteEntry, \
    TaskRouter, own_spread
from autotune.serving.routing.router_eval import measure_routing
from autotune.store.records import PROMPT_CHARS
from search_spaces.strategy import PLAIN, Strategy

CODE = (
    "def add(a, b):\n    \"\"\"Return the sum of a and b.\"\"\"\n",
    "def is_prime(n: int) -> bool:\n    \"\"\"Return True when n is prime.\"\"\"\n",
    "def reverse(s: str) -> str:\n    \"\"\"Return s reversed, e.g. reverse('abc') == 'cba'.\"\"\"\n",
)
COOKING = (
    "How long should I boil an egg for a soft yolk?",
    "What can I cook with leftover rice and eggs?",
    "How do I keep pasta from sticking when I boil it?",
)


def entries() -> list[RouteEntry]:
    return [
        RouteEntry("code", 1, Strategy(draft_length=6), CODE),
        RouteEntry("cooking", 2, PLAIN, COOKING),
    ]


def test_nearest_task_within_the_threshold():
    router = TaskRouter().fit(entries())
    code = router.route("def max_of(xs: list[int]) -> int:\n    \"\"\"Return the largest element of xs.\"\"\"\n")
    assert code.route == "code" and code.entry == entries()[0] and 0.0 <= code.distance < DEFAULT_ROUTE_DISTANCE
    cooking = router.route("How long do I boil rice?")
    assert cooking.route == "cooking" and cooking.entry.best_id == 2
    assert cooking.distance < router.route("How long is a marathon?").distance


def test_far_from_every_task_is_unknown():
    router = TaskRouter().fit(entries())
    nothing_known = router.route("Zebras migrate across savannahs")
    assert nothing_known == RouteDecision(UNKNOWN, 1.0, None)
    far = router.route("Translate to French: the weather is nice today and tomorrow.")
    assert far.route == UNKNOWN and far.entry is None and DEFAULT_ROUTE_DISTANCE <= far.distance <= 1.0


def test_threshold_bounds_what_is_routed():
    exact = CODE[0]
    assert TaskRouter(threshold=0.0).fit(entries()).route(exact).route == UNKNOWN  # strictly below 0: nothing
    assert TaskRouter(threshold=1.0).fit(entries()).route("Is an egg a fruit?").route == "cooking"
    for bad in (-0.1, 1.5, float("nan"), "0.5", True):
        with pytest.raises(ValueError, match="threshold"):
            TaskRouter(threshold=bad)


def test_no_entries_and_entries_without_prompts_route_nowhere():
    assert TaskRouter().fit([]).route("def f(): pass") == RouteDecision(UNKNOWN, 1.0, None)
    bare = RouteEntry("old", 7, PLAIN, ())
    blank = RouteEntry("blank", 8, PLAIN, ("", "  \n"))
    router = TaskRouter().fit([bare, blank])
    assert router.entries == () and router.unroutable == (bare, blank)
    assert router.route(CODE[0]) == RouteDecision(UNKNOWN, 1.0, None)
    router.fit([bare, *entries()])
    assert [e.task for e in router.entries] == ["code", "cooking"] and router.unroutable == (bare,)
    assert router.route(CODE[1]).route == "code"
    assert router.distances([CODE[1], COOKING[0]]).shape == (2, 2)


def test_refit_replaces_the_routes():
    router = TaskRouter().fit(entries())
    assert router.route(CODE[2]).route == "code"
    router.fit([RouteEntry("cooking", 2, PLAIN, COOKING)])
    decision = router.route(CODE[2])
    assert decision.route == UNKNOWN and decision.entry is None


def test_route_while_refitting_reads_a_whole_fit():
    router = TaskRouter().fit(entries())
    seen, errors = set(), []

    def refit() -> None:
        for _ in range(20):
            router.fit(entries())
            router.fit(entries()[:1])

    worker = threading.Thread(target=refit)
    worker.start()
    while worker.is_alive():
        try:
            seen.add(router.route(COOKING[1]).route)
        except Exception as exc:  # noqa: BLE001 - any error here is the failure
            errors.append(exc)
    worker.join()
    assert not errors and seen <= {"cooking", UNKNOWN}


def test_long_texts_are_clipped_like_stored_prompts():
    long = CODE[0] + "x = 1\n" * 100_000
    router = TaskRouter().fit([RouteEntry("code", 1, PLAIN, (long,)), entries()[1]])
    assert router.route(long).route == "code"
    assert router.route(long[:PROMPT_CHARS]).route == "code"


def test_measured_default_threshold_routes_real_task_prompts():
    """Fit on 20 prompts of two of HumanEval / GSM8K / MT-Bench, route 60 held-out prompts of all
    three (the third should be unknown): the default is the measured best, and it is good enough."""
    measured = measure_routing()
    assert len(measured.cases) == 9 and all(len(c.distances) == 60 for c in measured.cases)
    assert measured.accuracy(DEFAULT_ROUTE_DISTANCE) >= 0.78
    assert abs(measured.best_threshold() - DEFAULT_ROUTE_DISTANCE) <= 0.03  # the docstring's numbers still hold
    assert measured.accuracy(0.0) < 0.4 and measured.accuracy(1.0) < 0.7  # the measure can fail
    for case in measured.cases:
        if case.held in ("humaneval", "gsm8k"):  # code and maths route reliably, in and out
            assert case.share(DEFAULT_ROUTE_DISTANCE, case.expected) >= 0.9, case
    assert "accuracy" in measured.table() and np.isfinite(measured.cases[0].quantiles()).all()


def test_a_route_takes_texts_only_as_far_as_its_own_prompts_fall_apart():
    """Fitted as a server is after studies of 4 prompts of HumanEval, GSM8K and MT-Bench: XSum
    articles (the ``mixed`` stream's) fall within the threshold of HumanEval's centroid but farther
    than HumanEval's own prompts fall from each other, so they are unknown; held-out HumanEval and
    GSM8K prompts still route home. Power: the threshold alone sends articles to HumanEval."""
    from tests.helpers import routing_texts

    fitted = [RouteEntry(t, i, PLAIN, tuple(routing_texts(t, 4))) for i, t in enumerate(("humaneval", "gsm8k",
                                                                                         "mt-bench"))]
    articles = routing_texts("xsum", 12, offset=20)
    router, loose = TaskRouter().fit(fitted), TaskRouter(reach_slack=None).fit(fitted)
    assert router.reaches[0] < DEFAULT_ROUTE_DISTANCE and loose.reaches.tolist() == [DEFAULT_ROUTE_DISTANCE] * 3
    assert [router.route(t).route for t in articles] == [UNKNOWN] * 12
    assert sum(loose.route(t).route == "humaneval" for t in articles) >= 2  # the power check
    for task in ("humaneval", "gsm8k"):
        assert [router.route(t).route for t in routing_texts(task, 12, offset=20)] == [task] * 12


def test_own_spread_is_the_farthest_leave_one_out_distance():
    rows = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.6, 0.8]])
    spread = own_spread(rows, [3, 1])
    # group [e1, e2, e1]: e2 against the others' centroid (e1) is 1 - 0; a group of one row: 1.0
    assert spread.tolist() == pytest.approx([1.0, 1.0])
    # [e1, e1, (0.6, 0.8)]: the last against e1 is 1 - 0.6; each e1 against (1.6, 0.8) only 1 - 1.6 / 1.79
    assert own_spread(rows[[0, 2, 3]], [3]).tolist() == pytest.approx([0.4])
    assert own_spread(rows[[0, 2]], [2]).tolist() == pytest.approx([0.0])  # identical prompts: no spread
    # ... yet a route of identical prompts still takes its own text and a near copy (MIN_REACH)
    router = TaskRouter().fit([RouteEntry("code", 1, PLAIN, (CODE[0],) * 3), entries()[1]])
    assert router.spreads[0] == pytest.approx(0.0, abs=1e-9) and router.reaches[0] == MIN_REACH
    assert router.route(CODE[0]).route == "code"
    assert router.route(CODE[0] + "\n").route == "code"


def test_measured_reach_cuts_misroutes_where_routes_hold_few_prompts():
    """``REACH_SLACK`` on two protocols: fitted on 4 prompts of three of the ``mixed`` stream's seven
    tasks (every such set; the other four's prompts should be unknown), the reach routes clearly
    more as expected than the threshold alone; fitted on 20 prompts of two of three tasks (the
    threshold's own protocol), it costs at most half a point."""
    few = measure_routing(("humaneval", "gsm8k", "mt-bench", "xsum", "nq-open", "asdiv", "translation"),
                          fit_prompts=4, held_out=12, fitted=3)
    assert few.accuracy(DEFAULT_ROUTE_DISTANCE, REACH_SLACK) >= few.accuracy(DEFAULT_ROUTE_DISTANCE) + 0.05
    many = measure_routing()
    assert many.accuracy(DEFAULT_ROUTE_DISTANCE, REACH_SLACK) >= many.accuracy(DEFAULT_ROUTE_DISTANCE) - 0.005


def test_the_protocol_fits_sets_of_any_size():
    """``fitted`` tasks at once, every such set: one fitted task of three, routed by three sets."""
    measured = measure_routing(fit_prompts=3, held_out=5, fitted=1)
    assert len(measured.cases) == 9 and all(len(c.fitted) == 1 and len(c.distances) == 5 for c in measured.cases)
    assert sum(c.expected != "unknown" for c in measured.cases) == 3  # each set's own task; the rest unknown
