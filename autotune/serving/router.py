"""Which known task a request belongs to, from its prompt text: TF-IDF and nearest centroid.

Each stored best strategy of the served model / draft / hardware is a ``RouteEntry`` with the
routing texts of the prompts it was tuned on (``Storage.routes``; ``studies.routing_text``). The
router turns every prompt into a TF-IDF vector (lower-cased word and punctuation tokens, so code and
math keep their operators; sublinear tf; fitted on all entries' prompts), averages each entry's
L2-normalised vectors into one L2-normalised centroid, and routes a text to the entry of the nearest
centroid by cosine distance when that distance is below the threshold; otherwise the route is
``"unknown"``. Word bigrams, English stop words, character n-grams and 1-/3-nearest-neighbour
distances all measured no better on the protocol below (0.70-0.80), and n-grams fit 2-6x slower.

Measured threshold (``measure_routing()``; ``python -m autotune.serving.router`` prints it): fit on
the first 20 prompts of two of HumanEval, GSM8K and MT-Bench, route the next 60 prompts of all three
(those of the third task should be "unknown"), for each of the three pairs: 540 decisions. Cosine
distance to the nearest centroid (quantiles 0 / 10 / 50 / 90 / 100 %) and where the prompts went at
the default threshold 0.65 (expected route / unknown / another task):

====================  ==========  ==============================  =========  ==================
fitted on             held out    distance quantiles              expected   at 0.65
====================  ==========  ==============================  =========  ==================
humaneval + gsm8k     humaneval   0.23  0.27  0.37  0.51  0.59    humaneval  100 / 0 / 0 %
humaneval + gsm8k     gsm8k       0.01  0.02  0.04  0.07  0.11    gsm8k      100 / 0 / 0 %
humaneval + gsm8k     mt-bench    0.48  0.72  0.83  0.89  0.91    unknown    95 / - / 5 %
humaneval + mt-bench  humaneval   0.22  0.28  0.38  0.52  0.61    humaneval  100 / 0 / 0 %
humaneval + mt-bench  gsm8k       0.66  0.67  0.68  0.69  0.70    unknown    100 / - / 0 %
humaneval + mt-bench  mt-bench    0.52  0.58  0.71  0.82  0.90    mt-bench   27 / 67 / 7 %
gsm8k + mt-bench      humaneval   0.61  0.72  0.78  0.83  0.86    unknown    95 / - / 5 %
gsm8k + mt-bench      gsm8k       0.01  0.02  0.04  0.08  0.10    gsm8k      100 / 0 / 0 %
gsm8k + mt-bench      mt-bench    0.54  0.64  0.75  0.84  0.91    mt-bench   13 / 87 / 0 %
====================  ==========  ==============================  =========  ==================

Accuracy (decisions as expected) by threshold: 0.50: 0.746, 0.60: 0.787, **0.65: 0.811** (the only
maximum on a 0.01 grid), 0.70: 0.728, 0.80: 0.683, 0.90: 0.643. What the numbers say:

- Code and maths prompts route reliably (every held-out HumanEval and GSM8K prompt to its task).
- MT-Bench's open questions (writing, roleplay, reasoning, ...) lie about as far from their own
  centroid as unrelated tasks do, so most go to "unknown": the safe side (plain decoding, or the
  store's general-purpose strategy); 3-4 of its 60 (coding questions) go to HumanEval.
- The margin is thin on one side: GSM8K prompts lie 0.66-0.70 from the other tasks' centroids, so a
  threshold above 0.66 starts sending them to another task's strategy (lossless still, maybe slower).
- GSM8K's stored routing texts carry its five few-shot exemplars (they are in the same user turn),
  so a bare grade-school question without them lies 0.68-0.84 from the GSM8K centroid: "unknown"
  (a server whose clients send GSM8K-style requests without exemplars should be tuned on such prompts,
  e.g. ``autotune study --task prompts --data FILE``).

Entries without prompts (results recorded before prompts were stored, or by code that stored none)
cannot be routed to; they stay reachable by explicit strategy id. ``fit`` took ~50 ms for 300
prompts (300k characters) here and ``route`` ~1.5 ms; ``fit`` replaces the fitted state whole, so a
``route`` running beside it reads either the old or the new one.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.preprocessing import normalize

from autotune.records import clip_prompt
from search_spaces.strategy import Strategy

__all__ = [
    "DEFAULT_ROUTE_DISTANCE", "UNKNOWN", "RouteDecision", "RouteEntry", "RoutingCase", "RoutingMeasurement",
    "TaskRouter", "make_vectorizer", "measure_routing",
]

DEFAULT_ROUTE_DISTANCE = 0.65  # measured: see the module docstring and measure_routing()
UNKNOWN = "unknown"
TOKEN_PATTERN = r"(?u)\b\w+\b|[^\w\s]"  # words (any length) and single punctuation marks: code, math, prose
MEASURED_TASKS = ("humaneval", "gsm8k", "mt-bench")


@dataclass(frozen=True)
class RouteEntry:
    """A stored best strategy a request may be routed to: its task, row id, and tuning prompts."""

    task: str
    best_id: int
    strategy: Strategy
    prompts: tuple[str, ...] = ()


@dataclass(frozen=True)
class RouteDecision:
    """``route`` is the entry's task or ``"unknown"``; ``distance`` the cosine distance to the
    nearest centroid (1.0 when nothing can be routed to); ``entry`` is None for ``"unknown"``."""

    route: str
    distance: float
    entry: RouteEntry | None


def make_vectorizer() -> TfidfVectorizer:
    return TfidfVectorizer(lowercase=True, token_pattern=TOKEN_PATTERN, ngram_range=(1, 1), sublinear_tf=True)


@dataclass(frozen=True)
class _Fitted:
    entries: tuple[RouteEntry, ...]  # the routable ones, one centroid row each
    vectorizer: TfidfVectorizer | None = None
    centroids: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))  # [entries, vocab], rows L2 = 1


class TaskRouter:
    """Nearest-centroid router over TF-IDF vectors of the entries' prompts.

    A text routes to the entry whose centroid is nearest, when its cosine distance is strictly
    below ``threshold`` (so 0 routes nothing); else to ``"unknown"``. Entries with no (non-blank)
    prompts cannot be routed to: they remain reachable by explicit strategy id. With no routable
    entries every text is ``"unknown"`` at distance 1.0.
    """

    def __init__(self, threshold: float = DEFAULT_ROUTE_DISTANCE) -> None:
        if not isinstance(threshold, (int, float)) or isinstance(threshold, bool) or not 0.0 <= threshold <= 1.0:
            raise ValueError(f"route distance threshold must be a number in [0, 1] (cosine distance), got {threshold!r}")
        self.threshold = float(threshold)
        self._fitted = _Fitted(entries=())
        self.unroutable: tuple[RouteEntry, ...] = ()

    @property
    def entries(self) -> tuple[RouteEntry, ...]:
        """The entries a text can be routed to (those with prompts), in fitting order."""
        return self._fitted.entries

    def fit(self, entries: Iterable[RouteEntry]) -> "TaskRouter":
        """Fit on ``entries`` (replacing any earlier fit) and return self."""
        given = tuple(entries)
        usable = [(e, [clip_prompt(p) for p in e.prompts if p.strip()]) for e in given]
        routable = tuple(e for e, texts in usable if texts)
        self.unroutable = tuple(e for e, texts in usable if not texts)
        if not routable:
            self._fitted = _Fitted(entries=())
            return self
        vectorizer = make_vectorizer()
        matrix = normalize(vectorizer.fit_transform([t for _, texts in usable for t in texts]))
        sizes = [len(texts) for _, texts in usable if texts]
        bounds = np.cumsum([0, *sizes])
        means = np.vstack([np.asarray(matrix[lo:hi].mean(axis=0)) for lo, hi in itertools.pairwise(bounds)])
        self._fitted = _Fitted(entries=routable, vectorizer=vectorizer, centroids=normalize(means))
        return self

    def distances(self, texts: Sequence[str]) -> np.ndarray:
        """Cosine distance of each text to each routable entry's centroid: ``[len(texts), len(entries)]``."""
        return _distances(self._fitted, texts)

    def route(self, text: str) -> RouteDecision:
        fitted = self._fitted  # one snapshot: a concurrent fit replaces it whole
        if not fitted.entries:
            return RouteDecision(UNKNOWN, 1.0, None)
        row = _distances(fitted, [text])[0]
        best = int(row.argmin())
        distance = float(row[best])
        if distance < self.threshold:
            entry = fitted.entries[best]
            return RouteDecision(entry.task, distance, entry)
        return RouteDecision(UNKNOWN, distance, None)


def _distances(fitted: _Fitted, texts: Sequence[str]) -> np.ndarray:
    if fitted.vectorizer is None:
        return np.ones((len(texts), 0))
    vectors = normalize(fitted.vectorizer.transform([clip_prompt(t) for t in texts]))  # [texts, vocab]
    return np.clip(1.0 - np.asarray(vectors @ fitted.centroids.T), 0.0, 1.0)  # [texts, entries]


# ---------------------------------------------------------------------- measuring the threshold
@dataclass(frozen=True)
class RoutingCase:
    """Held-out prompts of ``held`` routed by a router fitted on the tasks ``fitted``."""

    fitted: tuple[str, ...]
    held: str
    distances: tuple[float, ...]  # to the nearest centroid
    nearest: tuple[str, ...]  # the nearest centroid's task

    @property
    def expected(self) -> str:
        return self.held if self.held in self.fitted else UNKNOWN

    def decisions(self, threshold: float) -> list[str]:
        return [task if d < threshold else UNKNOWN for d, task in zip(self.distances, self.nearest)]

    def share(self, threshold: float, route: str) -> float:
        decisions = self.decisions(threshold)
        return sum(d == route for d in decisions) / len(decisions)

    def quantiles(self, qs: Sequence[float] = (0.0, 0.1, 0.5, 0.9, 1.0)) -> list[float]:
        return [float(q) for q in np.quantile(self.distances, qs)]


@dataclass(frozen=True)
class RoutingMeasurement:
    cases: tuple[RoutingCase, ...]
    grid: tuple[float, ...] = tuple(round(0.01 * i, 2) for i in range(101))

    def accuracy(self, threshold: float) -> float:
        """Fraction of all held-out prompts routed as expected (own task, or unknown for the third)."""
        right = sum(case.share(threshold, case.expected) * len(case.distances) for case in self.cases)
        return right / sum(len(case.distances) for case in self.cases)

    def best_threshold(self) -> float:
        """The middle of the grid points with the highest accuracy."""
        scores = [self.accuracy(t) for t in self.grid]
        top = [t for t, s in zip(self.grid, scores) if s == max(scores)]
        return top[len(top) // 2]

    def table(self, threshold: float | None = None) -> str:
        """A markdown table of the measurement: distance quantiles, and where the held-out prompts
        go at ``threshold`` (default ``best_threshold()``): the expected route, unknown, another task."""
        th = self.best_threshold() if threshold is None else threshold
        lines = [f"| fitted on | held out | distance q0 / q10 / q50 / q90 / q100 | expected | at {th:.2f}: "
                 "expected / unknown / other task |", "|---|---|---|---|---|"]
        for case in self.cases:
            q = " / ".join(f"{x:.2f}" for x in case.quantiles())
            right, unknown = case.share(th, case.expected), case.share(th, UNKNOWN)
            other = 1.0 - right - (0.0 if case.expected == UNKNOWN else unknown)
            shown = f"{100 * right:.0f} / {'-' if case.expected == UNKNOWN else f'{100 * unknown:.0f}'} / {100 * other:.0f} %"
            lines.append(f"| {' + '.join(case.fitted)} | {case.held} | {q} | {case.expected} | {shown} |")
        total = sum(len(c.distances) for c in self.cases)
        curve = ", ".join(f"{t:.2f}: {self.accuracy(t):.3f}" for t in (0.5, 0.6, th, 0.7, 0.8, 0.9))
        lines.append(f"\naccuracy {self.accuracy(th):.3f} at threshold {th:.2f} over {total} decisions ({curve})")
        return "\n".join(lines)


def measure_routing(
    tasks: Sequence[str] = MEASURED_TASKS, fit_prompts: int = 20, held_out: int = 60,
) -> RoutingMeasurement:
    """For every pair of ``tasks``: fit on the first ``fit_prompts`` routing texts of each, then
    route the next ``held_out`` prompts of every task (the tasks outside the pair should be unknown).
    The tasks' data as ``load_prompts`` finds it (GSM8K: ``$AUTOTUNE_DATA_DIR``)."""
    from studies import load_prompts, routing_text

    texts = {t: [routing_text(p) for p in load_prompts(t, limit=fit_prompts + held_out)] for t in tasks}
    cases = []
    for pair in itertools.combinations(tasks, 2):
        router = TaskRouter().fit(RouteEntry(t, i, Strategy(), tuple(texts[t][:fit_prompts])) for i, t in enumerate(pair))
        for held in tasks:
            d = router.distances(texts[held][fit_prompts:])
            nearest = tuple(router.entries[j].task for j in d.argmin(axis=1))
            cases.append(RoutingCase(pair, held, tuple(float(x) for x in d.min(axis=1)), nearest))
    return RoutingMeasurement(tuple(cases))


if __name__ == "__main__":  # prints the table for docs/benchmarks.md
    print(measure_routing().table())
