"""The drafter contract every drafter kind joins, through ``build_decoder`` (the kind's registered
``build`` part) on tiny random-weight models: greedy output is the target's plain greedy output
with drafts taken; after decoding, the caches hold exactly a fresh prefill of the same tokens
(every rejected row rolled back); proposals stay within the decoder's width and length caps. A
toy kind (``FixedPhraseDrafter``) joins by one ``register`` call; each checker has a power check."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch

import runtime.decoding
from runtime.decoding import Decoder, GenerationConfig
from runtime.draft import CatchesUp, Draft
from runtime.draft_shapes import TreeShape
from runtime.kv_cache import KVCache
from runtime.loading import LoadedModel
from runtime.pipeline import ModelPool, build_decoder
from runtime.sampling import SamplingParams
from runtime.testing import noisy_copy, tiny_model
from runtime.transformer import CausalLM
from search_spaces.kinds import (
    DRAFT_MODEL, KINDS, LAYER_SKIP, PROMPT_LOOKUP, DrafterKind, kinds_with, register, unregister,
)
from search_spaces.layer_plan import LayerPlan
from search_spaces.strategy import PLAIN, Strategy

PROMPT = [5, 17, 3, 88, 42, 7, 5, 17, 3, 88]
NEW = 24
VOCAB = 96  # runtime.testing.tiny_model's
FIXED_PHRASE = "fixed-phrase"  # the toy kind


class FixedPhraseDrafter:
    """The toy kind: where the sequence ends with a prefix of ``phrase``, proposes the phrase's
    next tokens (the longest such prefix wins); elsewhere nothing."""

    def __init__(self, phrase: list[int]) -> None:
        self.phrase = list(phrase)
        self.history: list[int] = []

    def begin(self, prompt: list[int], capacity: int, target_cache: KVCache | None = None) -> None:
        self.history = list(prompt)

    def propose(self, k: int, params: SamplingParams, generator: torch.Generator) -> Draft:
        phrase, hist = self.phrase, self.history
        for j in range(min(len(phrase) - 1, len(hist)), 0, -1):
            if hist[len(hist) - j:] == phrase[:j]:
                return Draft(torch.tensor(phrase[j : j + k], dtype=torch.long), None)
        return Draft(torch.empty(0, dtype=torch.long), None)

    def observe(self, n_accepted: int, new_tokens: list[int], path: list[int] | None = None) -> None:
        self.history.extend(new_tokens)

    def reconfigure(self, strategy: Strategy) -> None:
        """Nothing to change: the decoder caps the draft length."""


def _tiny(name: str, hf: torch.nn.Module) -> LoadedModel:
    return LoadedModel(name=name, model_id=name, revision="test", hf_model=hf, tokenizer=None)


@pytest.fixture(scope="module")
def models() -> tuple[ModelPool, LoadedModel]:
    """A pool holding a tiny target and a noisy copy of it as the draft model ``tiny-draft``
    (fresh models: serving a target may repack its weights)."""
    target = tiny_model("llama", 0)
    pool = ModelPool()
    pool._models[("tiny-draft", "float32")] = _tiny("tiny-draft", noisy_copy(target, 0.05, seed=1))
    return pool, _tiny("tiny-target", target)


@pytest.fixture(scope="module")
def plain(models) -> list[int]:
    pool, target = models
    return build_decoder(pool, target, PLAIN).generate(PROMPT, GenerationConfig(max_new_tokens=NEW)).tokens


@pytest.fixture(scope="module", autouse=True)
def toy_kind(plain) -> Iterator[DrafterKind]:
    """The toy kind joins every layer in one call. Its phrase starts as the plain output does, then
    takes a wrong turn: it drafts from the first round on, with accepted and rejected tokens."""
    phrase = plain[:3] + [(plain[3] + 1) % VOCAB] + plain[4:10]
    kind = register(DrafterKind(FIXED_PHRASE), build=lambda pool, target, draft, s, lm: FixedPhraseDrafter(phrase))
    yield kind
    unregister(FIXED_PHRASE)


# each speculating kind's strategy (its fields; the toy's kind is registered by a fixture) and
# draft model: a new kind adds its case
CASES: dict[str, tuple[dict[str, Any], str | None]] = {
    DRAFT_MODEL: (dict(draft_length=4, draft_precision="float32", confidence_threshold=0.0), "tiny-draft"),
    LAYER_SKIP: (dict(draft_length=4, confidence_threshold=0.0, layer_plan=LayerPlan(n_layers=3, skip_mlp=(1,))),
                 None),
    PROMPT_LOOKUP: (dict(draft_length=4), None),
    FIXED_PHRASE: (dict(draft_length=4), None),
}
KIND_NAMES = [k.name for k in kinds_with(lambda k: k.speculates)] + [FIXED_PHRASE]


def _strategy(kind: str, tree: bool = False) -> Strategy:
    """``kind``'s case, as a tree where ``tree`` and the kind drafts trees."""
    strategy = Strategy(drafter=kind, **CASES[kind][0])
    if not tree or not KINDS[kind].model_drafts:
        return strategy
    return replace(strategy, tree_widths=(2, 2, 1, 1))


class Run:
    """One decode of ``PROMPT``, keeping every draft and the target's cache."""

    def __init__(self, decoder: Decoder) -> None:
        self.decoder, self.drafts, self.cache = decoder, [], None
        propose = decoder.propose

        def recorded(out, config, gen):
            draft = propose(out, config, gen)
            self.drafts.append(draft)
            return draft

        decoder.propose = recorded  # type: ignore[method-assign]

        def keep_cache(dec, tokens, cache, stats) -> None:
            self.cache = cache

        self.result = decoder.generate(PROMPT, GenerationConfig(max_new_tokens=NEW), before_round=keep_cache)
        self.tokens = self.result.tokens


def _decode(models, kind: str, tree: bool = False, width: int | None = None) -> Run:
    pool, target = models
    decoder = build_decoder(pool, target, _strategy(kind, tree), CASES[kind][1])
    decoder.step_width = width
    return Run(decoder)


# ------------------------------------------------------------------------------------------ checkers
def first_mismatch(got: list[int], want: list[int]) -> int | None:
    """The first position where ``got`` differs from ``want`` (a length difference counts); None if equal."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


def cache_mismatch(model: CausalLM, cache: KVCache, tokens: list[int], atol: float = 1e-4) -> str | None:
    """How ``cache`` differs from a fresh prefill of ``tokens`` by ``model`` (its length, or the
    first differing row's K/V), or None where they agree."""
    if cache.length != len(tokens):
        return f"cache holds {cache.length} rows, the sequence {len(tokens)}"
    fresh = model.new_cache(len(tokens) + 1)
    with torch.inference_mode():
        model(torch.tensor(tokens, device=model.device), fresh)
    n = len(tokens)
    for name in ("all_keys", "all_values"):
        got, want = getattr(cache, name)[:, :, :n].float(), getattr(fresh, name)[:, :, :n].float()
        bad = ((got - want).abs() > atol).any(dim=(0, 1, 3)).nonzero()
        if bad.numel():
            return f"{name} differ from row {int(bad[0])} on"
    return None


def widest(draft: Draft) -> int:
    """The most children of any node of ``draft`` (a chain: 1; nothing drafted: 0)."""
    if draft.parents is None:
        return min(int(draft.tokens.numel()), 1)
    counts: dict[int, int] = {}
    for p in draft.parents:
        counts[p] = counts.get(p, 0) + 1
    return max(counts.values(), default=0)


def _cache_problems(run: Run) -> list[str]:
    """The target's cache (and a drafting model's own) against fresh prefills of what it should hold."""
    seq = PROMPT + run.tokens[:-1]  # the last token is the next round's input: not run yet
    problems = [f"target: {m}" for m in [cache_mismatch(run.decoder.target, run.cache, seq)] if m]
    drafter = run.decoder.drafter
    if isinstance(drafter, CatchesUp) and drafter.cache is not run.cache:
        held = (PROMPT + run.tokens)[: len(PROMPT) + len(run.tokens) - len(drafter.pending)]
        problems += [f"draft: {m}" for m in [cache_mismatch(drafter.model, drafter.cache, held)] if m]
    return problems


# ------------------------------------------------------------------------------------------ contract
def test_every_speculating_kind_has_a_case():
    """A registered kind without a case here would skip the contract: each must add one."""
    assert set(KIND_NAMES) <= set(CASES) and FIXED_PHRASE in KINDS


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_greedy_output_is_plain_greedy(models, plain, kind):
    run = _decode(models, kind)
    assert run.result.stats.drafted > 0, "the kind never drafted: the check would say nothing"
    assert first_mismatch(run.tokens, plain) is None, (run.tokens, plain)


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_caches_after_rollbacks_equal_a_fresh_prefill(models, kind):
    run = _decode(models, kind, tree=True)
    stats = run.result.stats
    assert stats.drafted > stats.accepted, "nothing was rejected: no rollback to check"
    assert _cache_problems(run) == []


@pytest.mark.parametrize("kind", KIND_NAMES)
@pytest.mark.parametrize("cap", [1, 2])
def test_proposals_respect_the_width_and_length_caps(models, kind, cap):
    run = _decode(models, kind, tree=True, width=cap)
    drafted = [d for d in run.drafts if d.tokens.numel()]
    assert drafted
    strategy = _strategy(kind, tree=True)
    assert max(widest(d) for d in drafted) <= cap
    assert all(d.tokens.numel() <= strategy.max_tree_nodes for d in drafted)
    assert all(d.tokens.numel() <= strategy.draft_length for d in drafted if d.is_chain)


# ------------------------------------------------------------------------------------------ power
def _accept_every_draft(target_argmax: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """``accept_chain_greedy`` gone wrong: every draft accepted, the target's token after them."""
    k = draft.numel()
    return torch.cat([torch.tensor([k], device=draft.device), draft, target_argmax[k:k + 1]])


def test_power_a_wrong_acceptance_breaks_greedy_identity(models, plain, monkeypatch):
    """The identity check is not vacuous: accepting the toy's wrong turns changes the output."""
    monkeypatch.setattr(runtime.decoding, "accept_chain_greedy", _accept_every_draft)
    run = _decode(models, FIXED_PHRASE)
    assert run.result.stats.drafted > 0
    assert first_mismatch(run.tokens, plain) is not None


def test_power_a_rollback_keeping_a_stale_row_is_caught(models, monkeypatch):
    """A rollback that once keeps one rejected row too many leaves the target's cache unlike a
    fresh prefill: the cache check reports it."""
    rollback, slips = KVCache.rollback, []

    def slipping(cache: KVCache, length: int) -> None:
        if not slips and length < cache.length - 1 and cache.length > len(PROMPT) + 2:
            slips.append(length)
            length += 1
        rollback(cache, length)

    monkeypatch.setattr(KVCache, "rollback", slipping)
    run = _decode(models, FIXED_PHRASE)
    assert slips, "the mutant never ran"
    assert any(p.startswith("target") for p in _cache_problems(run))


def test_power_a_drafter_ignoring_the_width_cap_is_caught(models, monkeypatch):
    """A tree drafter that does not narrow under a cap drafts 2 children per node: caught."""
    monkeypatch.setattr(TreeShape, "narrowed", lambda self, width: self)
    run = _decode(models, DRAFT_MODEL, tree=True, width=1)
    assert max(widest(d) for d in run.drafts if d.tokens.numel()) > 1


def test_power_cache_check_sees_one_changed_row(models):
    """The cache comparison is sensitive to a single perturbed K row (and its length)."""
    run = _decode(models, PROMPT_LOOKUP)
    seq = PROMPT + run.tokens[:-1]
    assert cache_mismatch(run.decoder.target, run.cache, seq) is None
    run.cache.all_keys[:, :, 3] += 1e-2
    assert cache_mismatch(run.decoder.target, run.cache, seq) == "all_keys differ from row 3 on"
    assert cache_mismatch(run.decoder.target, run.cache, seq[:-1]) is not None
