"""Prompt lookup drafting: n-gram matching rules, and lossless decoding through the Decoder."""
from __future__ import annotations

import random

import pytest
import torch

from runtime.decoding import Decoder, GenerationConfig
from runtime.lookup import PromptLookupDrafter
from runtime.sampling import SamplingParams
from runtime.testing import tiny_model
from runtime.transformer import CausalLM

GREEDY = SamplingParams()
GEN = torch.Generator().manual_seed(0)
REPEATING = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3]


def drafter(history: list[int], max_ngram: int = 3, min_ngram: int = 1) -> PromptLookupDrafter:
    d = PromptLookupDrafter(max_ngram=max_ngram, min_ngram=min_ngram)
    d.begin(history, capacity=len(history) + 64)
    return d


def propose(d: PromptLookupDrafter, k: int) -> list[int]:
    draft = d.propose(k, GREEDY, GEN)
    assert draft.q is None and draft.is_chain
    assert draft.tokens.dtype == torch.long and draft.tokens.dim() == 1
    return draft.tokens.tolist()


def reference(history: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Brute force: longest n first, latest earlier occurrence, copy what follows (<= k)."""
    size = len(history)
    for n in range(min(max_ngram, size), min_ngram - 1, -1):
        suffix = history[size - n :]
        for start in range(size - n - 1, -1, -1):  # occurrence history[start : start + n]
            if history[start : start + n] == suffix:
                return history[start + n : start + n + k] if k else []
    return []


# ---------------------------------------------------------------- matching rules
def test_copies_continuation_of_repeated_pattern():
    assert propose(drafter(REPEATING), 2) == [4, 5]


def test_latest_match_wins():
    d = drafter([1, 2, 9, 1, 2, 8, 1, 2], max_ngram=2)
    assert propose(d, 1) == [8]


def test_longest_ngram_preferred():
    history = [5, 3, 4, 70, 6, 3, 4, 80, 5, 3, 4]
    assert propose(drafter(history, max_ngram=3), 1) == [70]  # [5, 3, 4] occurs earlier
    assert propose(drafter(history, max_ngram=2), 1) == [80]  # [3, 4]: the latest occurrence


def test_continuation_truncated_at_k_and_at_end_of_history():
    history = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    assert propose(drafter(history), 3) == [3, 4, 5]
    d = drafter([1, 2, 9, 1, 2])
    assert propose(d, 10) == [9, 1, 2]  # runs out at the end of the history
    assert propose(drafter([7, 7]), 5) == [7]  # overlapping occurrence: continuation is the suffix


def test_no_match_or_zero_k_gives_empty_draft():
    assert propose(drafter([1, 2, 3, 4]), 4) == []
    assert propose(drafter([1, 2, 1, 3], min_ngram=2), 4) == []  # only a unigram match, not allowed
    assert propose(drafter(REPEATING), 0) == []
    assert propose(drafter([1]), 3) == []
    fresh = PromptLookupDrafter()
    assert propose(fresh, 3) == []  # before begin: empty history


def test_observe_extends_history_and_index():
    d = drafter([1, 2, 3, 4])
    assert propose(d, 3) == []
    d.observe(0, [1, 2])
    assert d.history == [1, 2, 3, 4, 1, 2]
    assert propose(d, 3) == [3, 4, 1]
    d.observe(2, [3, 4, 9])
    assert d.history == [1, 2, 3, 4, 1, 2, 3, 4, 9]
    assert propose(d, 3) == []
    d.observe(0, [1, 2, 3])  # latest [1, 2, 3] is now at 4..6, followed by 4, 9
    assert propose(d, 3) == [4, 9, 1]


def test_begin_resets_history():
    d = drafter(REPEATING)
    d.begin([8, 9], capacity=10)
    assert d.history == [8, 9]
    assert propose(d, 3) == []


@pytest.mark.parametrize("max_ngram,min_ngram", [(3, 1), (4, 2), (1, 1)])
def test_matches_brute_force_reference(max_ngram, min_ngram):
    rng = random.Random(max_ngram * 10 + min_ngram)
    seq = [rng.randrange(4) for _ in range(300)]
    d = drafter(seq[:5], max_ngram, min_ngram)
    pos = 5
    while pos < len(seq):
        k = rng.randrange(0, 7)
        assert propose(d, k) == reference(seq[:pos], k, max_ngram, min_ngram), pos
        step = rng.randrange(1, 5)
        d.observe(step - 1, seq[pos : pos + step])
        pos += step
    assert d.history == seq


class CountingHistory:
    """A token history that counts how many of its elements the drafter reads."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = list(tokens)
        self.reads = 0

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i):
        out = self.tokens[i]
        self.reads += len(out) if isinstance(i, slice) else 1
        return out

    def __iter__(self):
        self.reads += len(self.tokens)
        return iter(self.tokens)

    def append(self, tok: int) -> None:
        self.tokens.append(tok)


@pytest.mark.parametrize("size", [200, 5000])
def test_lookup_work_does_not_grow_with_the_history(size):
    """Each propose/observe reads O(max_ngram^2 + k) history tokens whatever the history length
    (an index lookup, no scan): the work per round is the same at 200 and 5000 tokens."""
    rng = random.Random(0)
    d = drafter([rng.randrange(50) for _ in range(size)], max_ngram=3)
    d.history = CountingHistory(d.history)
    k, rounds = 4, 300
    for _ in range(rounds):
        tokens = d.propose(k, GREEDY, GEN).tokens.tolist()
        d.observe(len(tokens), tokens + [rng.randrange(50)])
    per_round = d.history.reads / rounds
    bound = 3 * (1 + 2 + 3) + k  # the suffix n-grams read on lookup and on append (<= k + 1 appends)
    assert per_round <= 2 * bound, per_round
    assert len(d.history) >= size + rounds


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"max_ngram": 0}, "max_ngram"),
        ({"min_ngram": 0}, "min_ngram"),
        ({"min_ngram": 1.5}, "min_ngram"),
        ({"max_ngram": True}, "max_ngram"),
        ({"max_ngram": 2, "min_ngram": 3}, "max_ngram"),
    ],
)
def test_constructor_validates(kwargs, field):
    with pytest.raises(ValueError, match=field):
        PromptLookupDrafter(**kwargs)


def test_negative_k_rejected():
    with pytest.raises(ValueError, match="k="):
        drafter(REPEATING).propose(-1, GREEDY, GEN)


# ---------------------------------------------------------------- end to end: lossless
@pytest.mark.parametrize("k", [2, 5])
def test_greedy_lookup_spec_equals_plain(k):
    target = tiny_model("llama", 40)
    cfg = GenerationConfig(max_new_tokens=48)
    plain = Decoder(CausalLM(target)).generate(REPEATING, cfg)
    spec = Decoder(CausalLM(target), PromptLookupDrafter(), draft_length=k, verify_width=k + 1).generate(
        REPEATING, cfg
    )
    assert spec.tokens == plain.tokens
    assert spec.stats.new_tokens == 48
    assert spec.stats.drafted > 0
    assert spec.stats.accepted > 0  # the model's greedy output loops, so copies get accepted
    assert spec.stats.target_forwards < plain.stats.target_forwards


def test_sampled_lookup_spec_gives_valid_tokens():
    target = tiny_model("llama", 41)
    vocab = CausalLM(target).dims.vocab
    decoder = Decoder(CausalLM(target), PromptLookupDrafter(max_ngram=2, min_ngram=1), draft_length=4, verify_width=5)
    drafted = 0
    for seed in range(3):
        cfg = GenerationConfig(max_new_tokens=32, sampling=SamplingParams(temperature=1.0), seed=seed)
        res = decoder.generate(REPEATING, cfg)
        assert len(res.tokens) == 32
        assert all(0 <= t < vocab for t in res.tokens)
        assert 0.0 <= res.stats.acceptance_rate <= 1.0
        drafted += res.stats.drafted
    assert drafted > 0
