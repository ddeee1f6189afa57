"""How well pending clusters group unknown traffic by task: the measurement behind ``form_vectors``.

``python -m autotune.serving.adaptive.cluster_eval`` sends the ``mixed`` stream's requests of
categories no study stored (default XSum, NQ-open and ASDiv; then with MT-Bench's questions) through
``PendingClusters`` in stream order, and prints the adjusted Rand index of the clusters against the
true categories, next to what the router's content words alone give, and what one assignment (a
request's, on the decode thread) took on average.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from unittest import mock

from sklearn.metrics import adjusted_rand_score

from autotune.serving.adaptive import clusters
from autotune.serving.adaptive.clusters import PendingClusters
from autotune.timing import Stopwatch

UNKNOWN_TASKS = ("xsum", "nq-open", "asdiv")


def cluster_ids(texts: Sequence[str], max_clusters: int = 64) -> tuple[list[int], float]:
    """The pending cluster each text joins, sent one by one (as the server assigns, then adds) ->
    (the ids, mean seconds of one ``assign``)."""
    pending = PendingClusters(max_clusters=max_clusters)
    out, assigning = [], Stopwatch()
    for text in texts:
        with assigning:
            cid = pending.assign(text)
        pending.add(cid, text)
        out.append(cid)
    return out, assigning.seconds / max(len(texts), 1)


def score(tasks: Sequence[str], block: int = 4, blocks_per_task: int = 3, offset: int = 20,
          vectors: Callable | None = None) -> tuple[float, int, float]:
    """-> (adjusted Rand index against the categories, clusters formed, mean seconds of one
    assignment) on the mixed stream of ``tasks``."""
    from studies import routing_text
    from studies.stream import mixed_stream

    requests = mixed_stream(tuple(tasks), block=block, blocks_per_task=blocks_per_task, offset=offset)
    texts = [routing_text(r.prompt) for r in requests]
    if vectors is None:
        ids, seconds = cluster_ids(texts)
    else:
        with mock.patch.object(clusters, "form_vectors", vectors):
            ids, seconds = cluster_ids(texts)
    return adjusted_rand_score([r.category for r in requests], ids), len(set(ids)), seconds


def content_only(texts: Sequence[str]):
    """The router's word TF-IDF alone (what pending clusters used before task form)."""
    from sklearn.preprocessing import normalize

    from autotune.serving.routing.router import make_vectorizer
    from autotune.store.records import clip_prompt

    return normalize(make_vectorizer().fit_transform([clip_prompt(t) for t in texts]))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", default=",".join(UNKNOWN_TASKS))
    p.add_argument("--block", type=int, default=4)
    p.add_argument("--blocks-per-task", type=int, default=3)
    p.add_argument("--offset", type=int, default=20)
    args = p.parse_args(argv)
    base = [t for t in args.tasks.split(",") if t]
    print("| categories | form + content: ARI (clusters) | content words only: ARI (clusters) | one assignment |")
    print("|---|---|---|---|")
    for tasks in (base, [*base, "mt-bench"]):
        form = score(tasks, args.block, args.blocks_per_task, args.offset)
        words = score(tasks, args.block, args.blocks_per_task, args.offset, vectors=content_only)
        print(f"| {', '.join(tasks)} | {form[0]:.3f} ({form[1]}) | {words[0]:.3f} ({words[1]}) | "
              f"{form[2] * 1e3:.1f} ms |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
