"""Lookup-first (``Strategy.lookup_first``) as a wrapper around a drafting model's round drafter:
a round first tries prompt lookup over the sequence, where ``LOOKUP_FIRST_MIN_NGRAM`` or more
tokens recur. A chain checks the copy with the model (``ChainDrafter``: the same draft for fewer
sequential forwards); a tree's round takes the copy alone as its draft (deterministic, ``q=None``)
and the model drafts nothing that round."""
from __future__ import annotations

import torch

from runtime.chain_drafting import ChainDrafter
from runtime.draft import DraftSteps
from runtime.draft_rounds import DraftHost
from runtime.draft_shapes import TreeShape
from runtime.lookup import PromptLookupDrafter
from runtime.sampling import SamplingParams
from runtime.tree_drafting import TreeDrafter


class LookupFirst:
    """``inner``'s rounds, each tried first from ``lookup`` (an n-gram index its owner keeps up to
    date); ``rounds`` counts the rounds that started from a copy."""

    def __init__(self, lookup: PromptLookupDrafter, inner: ChainDrafter | TreeDrafter) -> None:
        self.lookup = lookup
        self.inner = inner
        self.rounds = 0

    def propose(
        self, host: DraftHost, shape: TreeShape, k: int, params: SamplingParams, gen: torch.Generator
    ) -> DraftSteps:
        copied = self.lookup.propose(k, params, gen)
        if not copied.tokens.numel():
            return (yield from self.inner.propose(host, shape, k, params, gen))
        self.rounds += 1
        if isinstance(self.inner, ChainDrafter):  # a chain checks the copy; a tree drafts it alone
            return (yield from self.inner.propose(host, shape, k, params, gen, copy=copied.tokens.tolist()))
        return copied  # the committed tokens wait as the host's ``pending`` for its next catch-up
