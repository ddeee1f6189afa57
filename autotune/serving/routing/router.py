"""Which known task a request belongs to, from its prompt text: TF-IDF and nearest centroid.

Each stored best strategy of the served model / draft / hardware is a ``RouteEntry`` with the
routing texts of the prompts it was tuned on (``Storage.routes``; ``studies.routing_text``). The
router turns every prompt into a TF-IDF vector (lower-cased word and punctuation tokens, so code and
math keep their operators, each hashed: ``terms``, so a route's texts may be stored as hashed terms;
sublinear tf; fitted on all entries' prompts), averages each entry's
L2-normalised vectors into one L2-normalised centroid, and routes a text to the entry of the nearest
centroid by cosine distance when that distance is below the threshold; otherwise the route is
``"unknown"``. Word bigrams, English stop words, character n-grams and 1-/3-nearest-neighbour
distances all measured no better on the protocol below (0.70-0.80), and n-grams fit 2-6x slower.

The default threshold was measured, not chosen: fit on the first 20 prompts of two of HumanEval,
GSM8K and MT-Bench, route the next 60 of all three (those of the third task should be "unknown"),
every pair; 0.65 routed 0.811 of the 540 decisions as expected, the only maximum on a 0.01 grid
(``autotune.serving.routing.router_eval``; the table is in docs/benchmarks.md). Code and maths prompts
route reliably; most MT-Bench questions go to "unknown" (the safe side).

Each route also has a **reach**: it takes a text only within its own prompts' spread
(``own_spread``: the farthest of its prompts from the centroid of its others, x ``REACH_SLACK``),
where that is below the threshold. A route tuned on a few prompts of one template (a study's
``--limit 4``) has a tight centroid, and prose that happens to share its words falls between its
spread and the threshold: after studies of 4 prompts of HumanEval, GSM8K and MT-Bench, 4 of the
``mixed`` stream's 12 XSum articles routed to HumanEval (0.59-0.64 from its centroid, whose own
prompts lie within 0.51) and drafted with its prompt lookup. Measured by ``router_eval`` (fit on 4
prompts of three of the stream's seven tasks, every set, the other four's prompts unknown): 0.734
of the decisions as expected with the threshold alone, 0.825 with the reach; on the threshold's own
protocol above, 0.811 and 0.809. A route of one prompt has no spread: the threshold alone; one of
near-identical prompts still reaches ``MIN_REACH``.

Entries without prompts (results recorded before prompts were stored, or by code that stored none)
cannot be routed to; they stay reachable by explicit strategy id. ``fit`` replaces the fitted state
whole, so a ``route`` running beside it reads either the old or the new one.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.preprocessing import normalize

from autotune.serving.routing.terms import terms
from autotune.store.records import clip_prompt
from search_spaces.strategy import Strategy

__all__ = ["DEFAULT_ROUTE_DISTANCE", "MIN_REACH", "REACH_SLACK", "UNKNOWN", "RouteDecision", "RouteEntry",
           "TaskRouter", "centroids", "make_vectorizer", "own_spread", "reach"]

DEFAULT_ROUTE_DISTANCE = 0.65  # measured: autotune.serving.routing.router_eval
REACH_SLACK = 1.0  # a route's reach: its farthest own prompt's leave-one-out distance x this (router_eval)
# ... and at least this: a route of near-identical prompts still takes a text that differs in a few
# words (GSM8K's held-out prompts fall within 0.021 of the centroid of 4 stored ones)
MIN_REACH = 0.1
UNKNOWN = "unknown"


@dataclass(frozen=True)
class RouteEntry:
    """A stored best strategy a request may be routed to: its task, row id, and tuning prompts."""

    task: str
    best_id: int
    strategy: Strategy
    prompts: tuple[str, ...] = ()
    acceptance: float | None = None  # what the strategy was stored with (drift detection compares)
    history_id: int | None = None  # the history row the best row came from


@dataclass(frozen=True)
class RouteDecision:
    """``route`` is the entry's task or ``"unknown"``; ``distance`` the cosine distance to the
    nearest centroid (1.0 when nothing can be routed to); ``entry`` is None for ``"unknown"``."""

    route: str
    distance: float
    entry: RouteEntry | None


def make_vectorizer() -> TfidfVectorizer:
    """TF-IDF over hashed terms (``terms.terms``: a text's words, or a stored string of its terms)."""
    return TfidfVectorizer(analyzer=terms, sublinear_tf=True)


@dataclass(frozen=True)
class _Fitted:
    entries: tuple[RouteEntry, ...]  # the routable ones, one centroid row each
    vectorizer: TfidfVectorizer | None = None
    centroids: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))  # [entries, vocab], rows L2 = 1
    spreads: np.ndarray = field(default_factory=lambda: np.zeros(0))  # [entries]: ``own_spread``
    reaches: np.ndarray = field(default_factory=lambda: np.zeros(0))  # [entries]: the distance each routes within


class TaskRouter:
    """Nearest-centroid router over TF-IDF vectors of the entries' prompts.

    A text routes to the entry whose centroid is nearest, when its cosine distance is strictly
    below ``threshold`` (so 0 routes nothing); else to ``"unknown"``. Entries with no (non-blank)
    prompts cannot be routed to: they remain reachable by explicit strategy id. With no routable
    entries every text is ``"unknown"`` at distance 1.0.
    """

    def __init__(self, threshold: float = DEFAULT_ROUTE_DISTANCE, reach_slack: float | None = REACH_SLACK) -> None:
        if not isinstance(threshold, (int, float)) or isinstance(threshold, bool) or not 0.0 <= threshold <= 1.0:
            raise ValueError(f"route distance threshold must be a number in [0, 1] (cosine distance), got {threshold!r}")
        if reach_slack is not None and not (isinstance(reach_slack, (int, float)) and reach_slack > 0):
            raise ValueError(f"route reach slack must be a positive number or None, got {reach_slack!r}")
        self.threshold = float(threshold)
        self.reach_slack = None if reach_slack is None else float(reach_slack)
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
        cents = centroids(matrix, sizes)
        spreads = own_spread(matrix, sizes)
        self._fitted = _Fitted(entries=routable, vectorizer=vectorizer, centroids=cents, spreads=spreads,
                               reaches=reach(self.threshold, self.reach_slack, spreads))
        return self

    @property
    def spreads(self) -> np.ndarray:
        """Each routable entry's own spread (``own_spread``), ``[entries]``."""
        return self._fitted.spreads

    @property
    def reaches(self) -> np.ndarray:
        """The distance within which each routable entry takes a text (``[entries]``): the
        threshold, or less where the entry's own prompts lie closer together (``own_spread``)."""
        return self._fitted.reaches

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
        if distance < fitted.reaches[best]:
            entry = fitted.entries[best]
            return RouteDecision(entry.task, distance, entry)
        return RouteDecision(UNKNOWN, distance, None)


def centroids(vectors, sizes: Sequence[int]) -> np.ndarray:
    """L2-normalised mean of each consecutive group of ``sizes`` rows of L2-normalised ``vectors``:
    ``[len(sizes), vocab]``."""
    bounds = np.cumsum([0, *sizes])
    return normalize(np.vstack([np.asarray(vectors[lo:hi].mean(axis=0)) for lo, hi in itertools.pairwise(bounds)]))


def reach(threshold: float, slack: float | None, spreads: np.ndarray) -> np.ndarray:
    """The distance within which each route takes a text: ``threshold``, narrowed to ``slack`` x
    its own spread (at least ``MIN_REACH``) where that is less; ``slack`` None: the threshold alone."""
    if slack is None:
        return np.full(len(spreads), threshold)
    return np.minimum(threshold, np.maximum(slack * np.asarray(spreads, dtype=float), MIN_REACH))


def own_spread(vectors, sizes: Sequence[int]) -> np.ndarray:
    """For each consecutive group of ``sizes`` rows of L2-normalised ``vectors`` (an entry's
    prompts): the largest cosine distance of one of its rows to the centroid of the group's other
    rows (leave-one-out: how far a new prompt of that kind falls), ``[len(sizes)]``; 1.0 for a group
    of one row (no spread known: nothing narrows its reach)."""
    out = np.ones(len(sizes))
    for i, (lo, hi) in enumerate(itertools.pairwise(np.cumsum([0, *sizes]))):
        if hi - lo < 2:
            continue
        rows = np.asarray(vectors[lo:hi].todense() if hasattr(vectors, "todense") else vectors[lo:hi])
        others = rows.sum(axis=0, keepdims=True) - rows  # [rows, vocab]: each row's group without it
        norms = np.linalg.norm(others, axis=1)
        cos = np.einsum("ij,ij->i", rows, others) / np.where(norms > 0, norms, 1.0)
        out[i] = float(np.clip(1.0 - cos, 0.0, 1.0).max())
    return out


def _distances(fitted: _Fitted, texts: Sequence[str]) -> np.ndarray:
    if fitted.vectorizer is None:
        return np.ones((len(texts), 0))
    vectors = normalize(fitted.vectorizer.transform([clip_prompt(t) for t in texts]))  # [texts, vocab]
    return np.clip(1.0 - np.asarray(vectors @ fitted.centroids.T), 0.0, 1.0)  # [texts, entries]
