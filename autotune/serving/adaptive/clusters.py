"""Unknown traffic grouped by task form until a group becomes a route, and the new routes' names.

Requests of one kind share their form, not their words: summaries of different articles share
their instruction ("Summarise the following article..."), questions of an open-QA set their
template. A pending cluster therefore compares texts by two blocks of equal weight
(``FORM_WEIGHT``): the **form**, character 2-4-grams (within words) of the text's instruction part
(``instruction``: before its first blank line, else its first sentence), and the **content**, the
router's word TF-IDF over the whole text. Measured on the ``mixed`` stream's categories (4 per
block, 3 blocks each, prompts 20-31; ``python -m autotune.serving.adaptive.cluster_eval``): XSum,
NQ-open and ASDiv form one cluster each (adjusted Rand index 1.0, content words alone: 0.61); with
MT-Bench's questions, which share no template and stay apart, 0.82 (content alone: 0.50).

Used by ``autotune.serving.adaptive.adaptive`` on the decode worker's thread.
"""
from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
from scipy.sparse import csr_matrix, hstack
from sklearn.feature_extraction.text import ENGLISH_STOP_WORDS, TfidfVectorizer
from sklearn.preprocessing import normalize

from autotune.serving.adaptive.settings import PENDING_CLUSTERS, PENDING_TEXTS
from autotune.serving.routing.router import DEFAULT_ROUTE_DISTANCE, centroids, make_vectorizer
from autotune.serving.routing.terms import term, words
from autotune.store.records import clip_prompt

NEW_ROUTE_PREFIX = "auto:"
FORM_WEIGHT = 0.5  # share of the form block (the instruction's character n-grams) in the distance
INSTRUCTION_CHARS = 400  # the instruction part is looked for in this many leading characters
_SENTENCE_END = re.compile(r"[.?!:\n]")


def instruction(text: str) -> str:
    """The instruction part of a prompt: up to its first blank line (a template's instruction
    before its material), else its first sentence (to ``.``, ``?``, ``!``, ``:`` or a line end)."""
    head = text[:INSTRUCTION_CHARS]
    blank = head.find("\n\n")
    if blank > 0:
        return head[:blank]
    end = _SENTENCE_END.search(head)
    return head[: end.end()] if end else head


def form_vectors(texts: Sequence[str]) -> csr_matrix:
    """L2-normalised rows comparing ``texts`` by task form and content (``FORM_WEIGHT``; see the
    module's docstring), fitted on these texts. A stored route's text kept as hashed terms has no
    instruction to read: its form block is empty and its content block counts alone."""
    from autotune.serving.routing.terms import TERMS_PREFIX

    forms = ["" if t.startswith(TERMS_PREFIX) else instruction(t).lower() for t in texts]
    if any(forms):
        form = normalize(TfidfVectorizer(analyzer="char_wb", ngram_range=(2, 4), sublinear_tf=True)
                         .fit_transform(forms))
    else:
        form = csr_matrix((len(texts), 1))
    content = normalize(make_vectorizer().fit_transform([clip_prompt(t) for t in texts]))
    return normalize(hstack([np.sqrt(FORM_WEIGHT) * form, np.sqrt(1.0 - FORM_WEIGHT) * content]).tocsr())


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
    """Unknown requests grouped by task form until a group is big enough to become a route.

    A text joins the nearest cluster when its cosine distance to that cluster's centroid is below
    ``threshold`` (the router's threshold; ``form_vectors``, fitted on the pending texts and this
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
            vectors = form_vectors([*texts, clip_prompt(text)])
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
