"""Draft tree shapes: how many children each node gets (``TreeShape``, from a strategy by
``tree_shape``), the static layout of a fixed-width tree, and the vocabulary padding of a
restricted draft head."""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import torch
import torch.nn.functional as F

from runtime.tree import compile_tree
from search_spaces.strategy import Strategy, tree_node_bound


@dataclass(frozen=True)
class TreeShape:
    """How many children each node gets.

    ``widths[d]``: children per node at depth ``d`` (all of them expanded further); its length is
    the maximum depth. ``dynamic``: SWIFT's dynamic verification table ``((p_max, k), ...)``; when
    set, a node whose draft top-1 probability is ``<= p_max`` gets the top-``k`` candidates, and only
    the top-1 child is drafted further (a chain with alternatives). ``threshold``: a node whose draft
    top-1 probability is below it gets no children (confidence-aware early stop; depth >= 1)."""

    widths: tuple[int, ...]
    dynamic: tuple[tuple[float, int], ...] | None = None
    threshold: float = 0.0

    def children(self, depth: int, confidence: float) -> tuple[int, int]:
        """-> (number of children, how many of them are expanded at the next depth)."""
        if depth > 0 and confidence < self.threshold:
            return 0, 0
        if self.dynamic is not None:
            k = next((k for p_max, k in self.dynamic if confidence <= p_max), self.dynamic[-1][1])
            return k, 1
        w = self.widths[depth]
        return w, w

    def max_nodes(self) -> int:
        return tree_node_bound(self.widths, self.dynamic)

    def narrowed(self, width: int | None) -> "TreeShape":
        """This shape with at most ``width`` children per node (a batch under load drafts narrower
        trees, ``autotune.tuning.load``); ``None``: itself."""
        if width is None or max(self.widths, default=1) <= width:
            return self
        dynamic = None if self.dynamic is None else tuple((p, min(k, width)) for p, k in self.dynamic)
        return replace(self, widths=tuple(min(w, width) for w in self.widths), dynamic=dynamic)

    @property
    def is_chain(self) -> bool:
        """One node per depth (no widths above 1, no dynamic alternatives)."""
        return self.dynamic is None and all(w == 1 for w in self.widths)


def tree_shape(s: Strategy) -> TreeShape:
    """The draft tree a strategy asks for (a chain: width 1 at every depth)."""
    widths = s.tree_widths or (1,) * s.draft_length
    return TreeShape(widths=widths, dynamic=s.dynamic_widths, threshold=s.confidence_threshold)


@dataclass(frozen=True)
class StaticLayout:
    """A fixed-width draft tree in breadth-first order: its parents and, per drafted depth, the
    mask block of that depth's frontier over the round's rows so far (``[F, R]``, device)."""

    parents: tuple[int, ...]
    frontier_masks: tuple[torch.Tensor, ...]
    chain: bool


@lru_cache(maxsize=64)
def _static_layout(widths: tuple[int, ...], device: str) -> StaticLayout:
    parents: list[int] = []
    level = [-1]
    starts = []
    for w in widths:
        starts.append(len(parents))
        nxt = []
        for node in level:
            for _ in range(w):
                nxt.append(len(parents))
                parents.append(node)
        level = nxt
    tree = compile_tree(tuple(parents))
    seen = tree.mask[1:, 1:]  # [N, N] node -> itself and its ancestors
    masks = []
    for d in range(len(widths) - 1):  # depth d's nodes run to draft depth d + 1
        lo, hi = starts[d], starts[d + 1]
        masks.append(seen[lo:hi, :hi].to(device))
    return StaticLayout(tuple(parents), tuple(masks), all(w == 1 for w in widths))


def static_layout(widths: tuple[int, ...], device: torch.device | str) -> StaticLayout:
    return _static_layout(tuple(widths), str(device))


def node_depth(node: int, parents: list[int]) -> int:
    d = 0
    while node >= 0:
        node = parents[node]
        d += 1
    return d


def pad_vocab(q: torch.Tensor, vocab: int) -> torch.Tensor:
    """A restricted draft head gives q over ids [0, n); tokens beyond have q = 0."""
    return q if q.shape[-1] == vocab else F.pad(q, (0, vocab - q.shape[-1]))
