"""The one timing helper (``autotune.timing``): what each figure of a ``Timing`` is, that setup runs
untimed, and that a stopwatch sums its blocks."""
from __future__ import annotations

import time

import pytest

from autotune.timing import Stopwatch, Timing, time_blocked, time_calls


def test_a_timing_reports_median_best_and_interquartile_range():
    t = Timing((4.0, 1.0, 3.0, 2.0, 5.0), calls=5)
    assert t.median == 3.0 and t.best == 1.0
    assert t.iqr == pytest.approx(2.0)  # 4 - 2 (linear interpolation, as numpy's default)
    assert Timing((0.5,), calls=1).iqr == 0.0


def test_setup_runs_untimed_before_every_call():
    order: list[str] = []

    def setup() -> None:
        order.append("setup")
        time.sleep(0.05)  # would dominate the samples if it were timed

    timing = time_calls(lambda: order.append("call"), repeats=3, warm=True, setup=setup)
    assert order == ["setup", "call"] * 4  # the warm call, then three timed ones
    assert len(timing.samples) == 3 and timing.calls == 3
    assert timing.best < 0.04  # power: a timed setup would put every sample above 0.05 s


def test_time_calls_refuses_no_repeats():
    with pytest.raises(ValueError, match="repeats"):
        time_calls(lambda: None, repeats=0)


def test_blocked_timing_keeps_at_least_the_minimum_blocks():
    timing = time_blocked(lambda: time.sleep(0.002), min_run_time=0.01, min_blocks=4)
    assert len(timing.samples) >= 4 and timing.calls >= 4
    assert 0.0015 < timing.median < 0.05


def test_a_stopwatch_sums_its_blocks_and_nothing_between():
    watch = Stopwatch()
    with watch:
        time.sleep(0.02)
    time.sleep(0.1)  # outside any block
    with watch:
        time.sleep(0.02)
    assert 0.035 < watch.seconds < 0.09
