"""Matchness (SWIFT eq. 3): how well a candidate drafter predicts tokens the target already made.

The last ``window`` tokens of the sequence are scored in ONE parallel forward of the drafting
model under the candidate's layer plan, reusing the cache's exact K/V for the prefix before the
window (the window's rows are computed by the candidate itself, as when it drafts). The cache is
left exactly as it was.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.kv_cache import KVCache
from runtime.transformer import CausalLM
from search_spaces.layer_plan import LayerPlan

TOP_K = (1, 2, 3, 5, 10)


@dataclass(frozen=True)
class Match:
    """Per window position: did the draft's top-k contain the target's token, and how confident
    was the draft (top-1 probability)."""

    hits: torch.Tensor  # [W, len(TOP_K)] bool, column j: target token within the draft's top TOP_K[j]
    confidence: torch.Tensor  # [W] float

    @property
    def window(self) -> int:
        return int(self.hits.shape[0])

    @property
    def rate(self) -> float:
        """Exact-match rate of the draft's argmax (SWIFT's matchness)."""
        return float(self.hits[:, 0].float().mean()) if self.window else 0.0

    def topk_rate(self, k: int) -> float:
        return float(self.hits[:, TOP_K.index(k)].float().mean()) if self.window else 0.0


def usable_window(n_tokens: int, cache_length: int, window: int) -> int:
    """The largest window <= ``window`` whose prefix the cache holds exactly (0 if none)."""
    w = min(window, n_tokens - 1)
    return w if n_tokens - w - 1 <= cache_length else 0


def matchness(lm: CausalLM, cache: KVCache, plan: LayerPlan | None, tokens: list[int], window: int) -> Match:
    """Score ``plan`` on the last ``window`` tokens of ``tokens``; the cache holds exact K/V for
    (at least) ``tokens[: len(tokens) - window - 1]``."""
    n = len(tokens)
    w = usable_window(n, cache.length, window)
    if w == 0:
        raise ValueError(f"cannot score a window of {window}: {n} tokens, cache holds {cache.length}")
    start = n - w - 1  # first input slot: the token before the window predicts its first token
    with torch.inference_mode():
        snap = cache.snapshot(start)
        try:
            cache.length = start
            ids = torch.tensor(tokens[start : n - 1], dtype=torch.long, device=lm.device)
            logits = lm(ids, cache, plan=plan).float()  # [W, V]
        finally:
            cache.restore(start, snap)
    return score_logits(logits, torch.tensor(tokens[n - w :], dtype=torch.long))


def score_logits(logits: torch.Tensor, targets: torch.Tensor) -> Match:
    kmax = min(max(TOP_K), logits.shape[-1])
    top = torch.topk(logits, kmax, dim=-1).indices  # [W, kmax]
    eq = top == targets.to(top.device)[:, None]
    hits = torch.stack([eq[:, : min(k, kmax)].any(dim=-1) for k in TOP_K], dim=-1)
    conf = torch.softmax(logits, dim=-1).amax(dim=-1)
    return Match(hits.cpu(), conf.cpu())


@dataclass(frozen=True)
class LookupMatch:
    """Prompt lookup replayed on a window: for every window position, how many tokens the n-gram
    lookup would propose there (up to ``max_k``) and how many of them the target's tokens accept
    (the proposal's common prefix with what followed). Deterministic drafts, so greedy acceptance
    is exactly this prefix."""

    proposed: tuple[int, ...]
    accepted: tuple[int, ...]

    @property
    def window(self) -> int:
        return len(self.proposed)

    @property
    def rate(self) -> float:
        """Share of positions whose first proposed token is the target's (lookup's matchness)."""
        return sum(a > 0 for a in self.accepted) / self.window if self.window else 0.0


def lookup_match(tokens: list[int], window: int, max_k: int, min_ngram: int | None = None) -> LookupMatch:
    """Replay ``PromptLookupDrafter`` over the last ``window`` tokens of ``tokens`` (the history
    before each position is what the drafter would have held there). Pure token work, no model.
    ``min_ngram``: only n-grams of exactly that many tokens match (a draft model's
    ``lookup_first``); default: the drafter's own 3..1."""
    from runtime.lookup import PromptLookupDrafter

    n = len(tokens)
    w = min(window, n - 1)
    drafter = PromptLookupDrafter() if min_ngram is None else PromptLookupDrafter(max_ngram=min_ngram, min_ngram=min_ngram)
    drafter.begin(tokens[: n - w], 0)
    proposed, accepted = [], []
    for i in range(n - w, n):
        start = drafter.match(max_k)
        guess = drafter.history[start : start + max_k] if start is not None else []
        truth = tokens[i : i + len(guess)]
        a = 0
        while a < len(truth) and guess[a] == truth[a]:
            a += 1
        proposed.append(len(guess))
        accepted.append(a)
        drafter.observe(0, [tokens[i]])
    return LookupMatch(tuple(proposed), tuple(accepted))
