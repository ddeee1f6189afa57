"""Prompt lookup decoding: a drafter with no draft model that copies tokens from the context.

Leviathan et al. 3.6 (negligible-cost heuristic drafts): when long spans are likely to repeat
(summaries, code edits, chat over a document), find an earlier occurrence of the sequence's last
n tokens and propose the tokens that followed it. Drafting costs a dict lookup (c ~ 0), and the
output stays lossless because the target verifies every token (the draft is deterministic, so
``q=None``: verified as one-hot).
"""
from __future__ import annotations

import torch

from runtime.draft import Draft
from runtime.sampling import SamplingParams


# the n-gram sizes a lookup matches, longest first (vLLM's prompt_lookup_max / prompt_lookup_min): a
# lone recurring token proposes noise that a verify pays for, and the longest match picks the right
# occurrence (measured against (3, 1): docs/benchmarks.md, "Prompt lookup's n-grams")
DEFAULT_MAX_NGRAM, DEFAULT_MIN_NGRAM = 8, 2


class PromptLookupDrafter:
    """Drafts by n-gram lookup over the token history (prompt + committed tokens).

    ``propose(k)`` takes the last ``n`` history tokens for ``n = max_ngram .. min_ngram`` (longest
    first), finds their latest earlier occurrence, and returns up to ``k`` tokens that followed it
    (fewer when the history runs out; none when no n-gram matches).

    Index: ``self.index[ngram] = p`` where ``history[p - n : p] == ngram`` is the latest occurrence
    with at least one token after it (``p < len(history)``). An n-gram ending at position ``i`` is
    registered when token ``i + 1`` arrives, so the history's own suffix is never its own match.
    Lookup is O(max_ngram) per round; appending a token is O(max_ngram - min_ngram + 1).
    """

    def __init__(self, max_ngram: int = DEFAULT_MAX_NGRAM, min_ngram: int = DEFAULT_MIN_NGRAM) -> None:
        _check_positive_int("min_ngram", min_ngram)
        _check_positive_int("max_ngram", max_ngram)
        if max_ngram < min_ngram:
            raise ValueError(
                f"max_ngram={max_ngram} must be >= min_ngram={min_ngram}; "
                "lower min_ngram or raise max_ngram"
            )
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.history: list[int] = []
        self.index: dict[tuple[int, ...], int] = {}

    def begin(self, prompt: list[int], capacity: int, target_cache: object = None) -> None:
        """Reset to ``prompt`` (the decode loop passes prompt + first token). ``capacity`` is unused:
        no cache is kept."""
        self.history = []
        self.index = {}
        self._extend(prompt)

    def propose(self, k: int, params: SamplingParams, generator: torch.Generator) -> Draft:
        """-> Draft(tokens [n] long with 0 <= n <= k, q=None); ``params``/``generator`` unused
        (the lookup is deterministic whatever the sampling settings)."""
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"k={k!r} must be a non-negative integer (the number of tokens to draft)")
        start = self.match(k)
        tokens = self.history[start : start + k] if start is not None else []
        return Draft(torch.tensor(tokens, dtype=torch.long), None)

    def match(self, k: int = 1) -> int | None:
        """Position in ``history`` where the copied continuation starts, or None (no match / k=0).

        Tries the last ``n`` tokens for ``n`` from ``max_ngram`` down to ``min_ngram``; the
        first n with an earlier occurrence wins, and among its occurrences the latest."""
        if k == 0:
            return None
        hist = self.history
        for n in range(min(self.max_ngram, len(hist)), self.min_ngram - 1, -1):
            start = self.index.get(tuple(hist[len(hist) - n :]))
            if start is not None:
                return start
        return None

    def reconfigure(self, strategy: object) -> None:
        """Nothing to change: a lookup draft's only setting is its length, which the decoder caps."""

    def observe(self, n_accepted: int, new_tokens: list[int], path: list[int] | None = None) -> None:
        """Append the tokens committed this round (accepted drafts + the target's next token)."""
        self._extend(new_tokens)

    def _extend(self, tokens: list[int]) -> None:
        """Append ``tokens``; index every n-gram that now has a following token."""
        hist, index = self.history, self.index
        for tok in tokens:
            end = len(hist)  # n-grams ending just before `end` gain their continuation `tok`
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                index[tuple(hist[end - n : end])] = end
            hist.append(int(tok))


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer (an n-gram length in tokens)")
