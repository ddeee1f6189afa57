"""How well the task router separates real tasks: the measurement behind ``DEFAULT_ROUTE_DISTANCE``.

``python -m autotune.serving.routing.router_eval`` prints the table in docs/benchmarks.md (GSM8K from
``$AUTOTUNE_DATA_DIR``).
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autotune.serving.routing.router import UNKNOWN, RouteEntry, TaskRouter, reach
from search_spaces.strategy import Strategy

MEASURED_TASKS = ("humaneval", "gsm8k", "mt-bench")
SLACKS = (None, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5)  # reach slacks the table compares (``TaskRouter(reach_slack=)``)


@dataclass(frozen=True)
class RoutingCase:
    """Held-out prompts of ``held`` routed by a router fitted on the tasks ``fitted``."""

    fitted: tuple[str, ...]
    held: str
    distances: tuple[float, ...]  # to the nearest centroid
    nearest: tuple[str, ...]  # the nearest centroid's task
    spreads: tuple[float, ...] = ()  # the nearest entry's own spread (``router.own_spread``), per prompt

    @property
    def expected(self) -> str:
        return self.held if self.held in self.fitted else UNKNOWN

    def decisions(self, threshold: float, slack: float | None = None) -> list[str]:
        """Each prompt's route at ``threshold``, each entry's reach narrowed to ``slack`` x its own
        spread (None: the threshold alone), as ``TaskRouter(threshold, slack)`` routes."""
        spreads = self.spreads or (1.0,) * len(self.distances)
        reaches = reach(threshold, slack, np.asarray(spreads))
        return [task if d < r else UNKNOWN for d, task, r in zip(self.distances, self.nearest, reaches)]

    def share(self, threshold: float, route: str, slack: float | None = None) -> float:
        decisions = self.decisions(threshold, slack)
        return sum(d == route for d in decisions) / len(decisions)

    def quantiles(self, qs: Sequence[float] = (0.0, 0.1, 0.5, 0.9, 1.0)) -> list[float]:
        return [float(q) for q in np.quantile(self.distances, qs)]


@dataclass(frozen=True)
class RoutingMeasurement:
    cases: tuple[RoutingCase, ...]
    grid: tuple[float, ...] = tuple(round(0.01 * i, 2) for i in range(101))

    def accuracy(self, threshold: float, slack: float | None = None) -> float:
        """Fraction of all held-out prompts routed as expected (own task, or unknown for the third)."""
        right = sum(case.share(threshold, case.expected, slack) * len(case.distances) for case in self.cases)
        return right / sum(len(case.distances) for case in self.cases)

    def best_threshold(self, slack: float | None = None) -> float:
        """The middle of the grid points with the highest accuracy."""
        scores = [self.accuracy(t, slack) for t in self.grid]
        top = [t for t, s in zip(self.grid, scores) if s == max(scores)]
        return top[len(top) // 2]

    def table(self, threshold: float | None = None, slack: float | None = None) -> str:
        """A markdown table of the measurement: distance quantiles, and where the held-out prompts
        go at ``threshold`` (default ``best_threshold()``) and reach ``slack``: the expected route,
        unknown, another task; then the accuracy at each slack of ``SLACKS``."""
        th = self.best_threshold(slack) if threshold is None else threshold
        lines = [f"| fitted on | held out | distance q0 / q10 / q50 / q90 / q100 | expected | at {th:.2f}: "
                 "expected / unknown / other task |", "|---|---|---|---|---|"]
        for case in self.cases:
            q = " / ".join(f"{x:.2f}" for x in case.quantiles())
            right, unknown = case.share(th, case.expected, slack), case.share(th, UNKNOWN, slack)
            other = 1.0 - right - (0.0 if case.expected == UNKNOWN else unknown)
            shown = f"{100 * right:.0f} / {'-' if case.expected == UNKNOWN else f'{100 * unknown:.0f}'} / {100 * other:.0f} %"
            lines.append(f"| {' + '.join(case.fitted)} | {case.held} | {q} | {case.expected} | {shown} |")
        total = sum(len(c.distances) for c in self.cases)
        curve = ", ".join(f"{t:.2f}: {self.accuracy(t, slack):.3f}" for t in (0.5, 0.6, th, 0.7, 0.8, 0.9))
        lines.append(f"\naccuracy {self.accuracy(th, slack):.3f} at threshold {th:.2f}, reach slack {slack} over "
                     f"{total} decisions ({curve})")
        by_slack = ", ".join(f"{s}: {self.accuracy(th, s):.3f}" for s in SLACKS)
        lines.append(f"at threshold {th:.2f}, by reach slack (None: the threshold alone): {by_slack}")
        return "\n".join(lines)


def measure_routing(
    tasks: Sequence[str] = MEASURED_TASKS, fit_prompts: int = 20, held_out: int = 60, fitted: int = 2,
) -> RoutingMeasurement:
    """For every set of ``fitted`` of ``tasks`` (pairs by default): fit on the first ``fit_prompts``
    routing texts of each, then route the next ``held_out`` prompts of every task (the tasks outside
    the set should be unknown). The tasks' data as ``load_prompts`` finds it (GSM8K:
    ``$AUTOTUNE_DATA_DIR``)."""
    from studies import load_prompts, routing_text

    texts = {t: [routing_text(p) for p in load_prompts(t, limit=fit_prompts + held_out)] for t in tasks}
    cases = []
    for group in itertools.combinations(tasks, fitted):
        entries = [RouteEntry(t, i, Strategy(), tuple(texts[t][:fit_prompts])) for i, t in enumerate(group)]
        router = TaskRouter().fit(entries)
        spread = {e.task: float(r) for e, r in zip(router.entries, router.spreads)}
        for held in tasks:
            d = router.distances(texts[held][fit_prompts:])
            nearest = tuple(router.entries[j].task for j in d.argmin(axis=1))
            cases.append(RoutingCase(group, held, tuple(float(x) for x in d.min(axis=1)), nearest,
                                     tuple(spread[t] for t in nearest)))
    return RoutingMeasurement(tuple(cases))


def main(argv: Sequence[str] | None = None) -> None:
    """Prints the table for docs/benchmarks.md (the defaults: the measurement behind the threshold)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m autotune.serving.routing.router_eval")
    p.add_argument("--tasks", default=",".join(MEASURED_TASKS), help="comma list of tasks")
    p.add_argument("--fit-prompts", type=int, default=20, help="prompts each fitted task's route holds")
    p.add_argument("--held-out", type=int, default=60, help="prompts of each task routed")
    p.add_argument("--fitted", type=int, default=2, help="tasks fitted at once (every such set is measured)")
    p.add_argument("--threshold", type=float, help="the threshold the table shows (default: the best one)")
    p.add_argument("--reach-slack", type=float, help="each route's reach: its own spread x this (default: none, "
                   "the threshold alone; serve's is router.REACH_SLACK)")
    args = p.parse_args(argv)
    if args.reach_slack is not None and not args.reach_slack > 0:
        p.error(f"--reach-slack must be a positive number, got {args.reach_slack}")
    tasks = [t for t in args.tasks.split(",") if t]
    if not 1 <= args.fitted < len(tasks):
        p.error(f"--fitted must be between 1 and the number of tasks less one ({len(tasks) - 1}), got {args.fitted}")
    from studies.errors import TaskError

    try:
        measured = measure_routing(tasks, args.fit_prompts, args.held_out, args.fitted)
    except TaskError as exc:  # an unknown task, or data not found: one line
        p.error(str(exc))
    print(measured.table(args.threshold, args.reach_slack))


if __name__ == "__main__":
    main()
