"""Unknown traffic grouped by topic until a group becomes a route, and the new routes' names.

Used by ``autotune.serving.adaptive.adaptive`` on the decode worker's thread.
"""
from __future__ import annotations

import re

import numpy as np
from sklearn.feature_extraction.text import ENGLISH_STOP_WORDS, TfidfVectorizer
from sklearn.preprocessing import normalize

from autotune.serving.adaptive.settings import PENDING_CLUSTERS, PENDING_TEXTS
from autotune.serving.routing.router import DEFAULT_ROUTE_DISTANCE, centroids, make_vectorizer
from autotune.serving.routing.terms import term, words
from autotune.store.records import clip_prompt

NEW_ROUTE_PREFIX = "auto:"


def new_route_name(texts: list[str], known: list[str], terms: int = 2, readable: bool = True) -> str:
    """``auto:`` + the pending texts' top TF-IDF words (fitted on them and the known routes'
    prompts, so words every route shares rank low), e.g. ``auto:summarize-article``. Not
    ``readable`` (the server does not store request text): ``auto:topic-`` + a hash of those
    words, e.g. ``auto:topic-3f9a01c2`` (the same topic gets the same name on every replica)."""
    vectorizer = TfidfVectorizer(analyzer=words, sublinear_tf=True)
    matrix = vectorizer.fit_transform(list(texts) + list(known))
    weights = np.asarray(matrix[: len(texts)].mean(axis=0)).ravel()
    names = vectorizer.get_feature_names_out()
    picked: list[str] = []
    for i in np.argsort(-weights, kind="stable"):
        word = str(names[i])
        if weights[i] <= 0:
            break
        if re.fullmatch(r"[a-z][a-z_]{2,}", word) and word not in ENGLISH_STOP_WORDS and word not in picked:
            picked.append(word)
        if len(picked) == terms:
            break
    topic = "-".join(picked) or "general"
    return NEW_ROUTE_PREFIX + (topic if readable else f"topic-{term(topic)}")


class PendingClusters:
    """Unknown requests grouped by topic until a group is big enough to become a route.

    A text joins the nearest cluster when its cosine distance to that cluster's TF-IDF centroid is
    below ``threshold`` (the router's vectors and threshold, fitted on the pending texts and this
    one: a vocabulary fitted without it would see only the words it shares); otherwise it
    opens a new cluster. At most ``max_clusters`` are kept (opening one more drops the one that
    grew least recently: its id goes to ``evicted``, so a re-tune of it can be dropped too) and
    ``max_texts`` texts per cluster. Cluster ids are never reused.
    """

    def __init__(self, threshold: float = DEFAULT_ROUTE_DISTANCE, max_clusters: int = PENDING_CLUSTERS,
                 max_texts: int = PENDING_TEXTS) -> None:
        self.threshold, self.max_clusters, self.max_texts = threshold, max_clusters, max_texts
        self.clusters: dict[int, list[str]] = {}  # id -> texts, least recently grown first
        self.evicted: list[int] = []  # ids dropped to make room, until ``take_evicted``
        self._next = 0

    def assign(self, text: str) -> int:
        """The id of the cluster ``text`` belongs to (a new id when it is near none); adds nothing."""
        if self.clusters:
            ids = list(self.clusters)
            texts = [clip_prompt(t) for cid in ids for t in self.clusters[cid]]
            vectors = normalize(make_vectorizer().fit_transform([*texts, clip_prompt(text)]))
            means = centroids(vectors[:len(texts)], [len(self.clusters[cid]) for cid in ids])
            distances = 1.0 - np.asarray(vectors[len(texts):] @ means.T).ravel()
            nearest = int(distances.argmin())
            if distances[nearest] < self.threshold:
                return ids[nearest]
        self._next += 1
        return self._next - 1

    def add(self, cid: int, text: str) -> int:
        """Add ``text`` to cluster ``cid`` (opening it if new); -> the cluster's size."""
        texts = self.clusters.pop(cid, None)
        if texts is None:
            texts = []
            while len(self.clusters) >= self.max_clusters:
                stalest = next(iter(self.clusters))
                del self.clusters[stalest]
                self.evicted.append(stalest)
        texts = (texts + [text])[-self.max_texts:]
        self.clusters[cid] = texts  # now the most recently grown
        return len(texts)

    def touch(self, cid: int) -> None:
        """Count ``cid`` as grown now (its re-tune is decoding its requests)."""
        if cid in self.clusters:
            self.clusters[cid] = self.clusters.pop(cid)

    def take_evicted(self) -> list[int]:
        out, self.evicted = self.evicted, []
        return out

    def texts(self, cid: int) -> list[str]:
        return list(self.clusters.get(cid, ()))

    def drop(self, cid: int) -> None:
        self.clusters.pop(cid, None)

    def sizes(self) -> dict[int, int]:
        return {cid: len(texts) for cid, texts in self.clusters.items()}


def unique_name(name: str, taken: set[str]) -> str:
    """``name``, or ``name-2``, ``name-3``... when a route of that name exists (a topic seen twice
    is a new route of its own, never an overwrite of the first)."""
    n = 1
    candidate = name
    while candidate in taken:
        n += 1
        candidate = f"{name}-{n}"
    return candidate
