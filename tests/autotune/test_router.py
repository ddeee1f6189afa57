"""The task router: TF-IDF nearest centroid with a distance threshold, and its measured default on
real task prompts (HumanEval, GSM8K, MT-Bench; no models)."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from autotune.serving.routing.router import DEFAULT_ROUTE_DISTANCE, UNKNOWN, RouteDecision, RouteEntry, TaskRouter
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


def test_the_protocol_fits_sets_of_any_size():
    """``fitted`` tasks at once, every such set: one fitted task of three, routed by three sets."""
    measured = measure_routing(fit_prompts=3, held_out=5, fitted=1)
    assert len(measured.cases) == 9 and all(len(c.fitted) == 1 and len(c.distances) == 5 for c in measured.cases)
    assert sum(c.expected != "unknown" for c in measured.cases) == 3  # each set's own task; the rest unknown
