"""Speculative sampling reproduces the target's distribution in every drafting mode, and the
check is strong enough to notice when it does not (see ``distribution.py`` for the harness).

Every mode decodes with a draft that really differs from the target (an independently seeded
model, a fuzzy or skipping plan, int8 weights, a restricted head, n-gram lookup), drafts to
depth >= 2 in its first round, and is checked on the joint distribution of three tokens: the
prefill's token, then tokens from depth-1 / depth-2 drafts, residual or bonus draws.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import pytest
import torch

import runtime.chain_drafting
import runtime.decoding
import runtime.sampling
import runtime.tree_verify
from runtime.batching import Member, batch_round
from runtime.decoding import Decoder, GenerationConfig
from runtime.drafters import Draft, ModelDrafter, SelfDrafter, TreeShape
from runtime.linear import mkl_packing_available
from runtime.lookup import PromptLookupDrafter
from runtime.sampling import SamplingParams, sample
from runtime.transformer import CausalLM
from runtime.tree import CompiledTree
from search_spaces.layer_plan import LayerPlan, easyspec_plan
from search_spaces.strategy import PLAIN, Strategy

from tests.runtime.distribution import (
    ALPHA, PROMPT, V, Exact, Sample, assert_matches_target, check_speculated, chi_square, exact_joint,
    model_decoder, sample_joint, spread_model,
)

T1 = SamplingParams(temperature=1.0)
TRUNCATED = SamplingParams(temperature=0.7, top_k=4, top_p=0.9)
CHAIN = TreeShape((1, 1, 1))
TREE = TreeShape((3, 2, 1))
THRESHOLD = TreeShape((2, 2, 1), threshold=0.5)
DYNAMIC = TreeShape((1, 1, 1), dynamic=((0.5, 3), (1.0, 1)))
PACKED_TREE = TreeShape((2, 2, 1))  # a shape no dense mode uses: its samples are its own
LOOKUP_PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # repeats: the n-gram lookup finds a continuation
HEAD = 3  # restricted draft head: tokens 3 and 4 get q = 0


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Thousands of tiny forwards: threads only add overhead (and the machine is shared)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models() -> dict[str, torch.nn.Module]:
    """target: 2 layers; draft: an independently seeded 1-layer model (acceptance ~0.45 as a
    chain); plan_draft: 4 layers for an EasySpec plan; self_target: 3 layers for self-drafting."""
    return {
        "target": spread_model(20),
        "draft": spread_model(25, layers=1),
        "plan_draft": spread_model(27, layers=4),
        "self_target": spread_model(30, layers=3),
    }


@dataclass
class Case:
    decoder: Decoder
    reference: CausalLM  # the target the exact distribution is computed with
    params: SamplingParams = T1
    prompt: list[int] = field(default_factory=lambda: list(PROMPT))
    depth: int = 3  # the first round's draft depth
    checks: dict[str, Any] = field(default_factory=dict)  # check_speculated options
    extra: Callable[[Exact, Sample], None] | None = None  # checks of this mode only


Builder = Callable[[dict[str, torch.nn.Module], pytest.MonkeyPatch], Case]


def _draft_case(shape: TreeShape, params: SamplingParams = T1, **checks: Any) -> Builder:
    def build(m: dict[str, torch.nn.Module], _: pytest.MonkeyPatch) -> Case:
        target = CausalLM(m["target"])
        return Case(model_decoder(target, CausalLM(m["draft"]), shape), target, params, checks=checks)

    return build


def _easyspec(calibrate: bool) -> Builder:
    def build(m: dict[str, torch.nn.Module], _: pytest.MonkeyPatch) -> Case:
        target = CausalLM(m["target"])
        plan = easyspec_plan(4, 2)
        assert plan.groups == ((1, 2),)
        return Case(model_decoder(target, CausalLM(m["plan_draft"]), CHAIN, plan, calibrate), target)

    return build


def _self_draft(m: dict[str, torch.nn.Module], _: pytest.MonkeyPatch) -> Case:
    target = CausalLM(m["self_target"])
    drafter = SelfDrafter(target, LayerPlan(3, skip_attn=(1,)), CHAIN)
    return Case(Decoder(target, drafter, 3, verify_width=CHAIN.max_nodes() + 1), target)


def _int8_draft(m: dict[str, torch.nn.Module], _: pytest.MonkeyPatch) -> Case:
    target, draft = CausalLM(m["target"]), CausalLM(m["draft"])
    draft.use_linear_backend("int8")
    return Case(model_decoder(target, draft, CHAIN), target)


def _quantised_target(backend: str, shape: TreeShape) -> Builder:
    """A quantised target (row-invariant kernels at every width): speculation must reproduce the
    distribution of the quantised model it serves, which is also the reference."""
    def build(m: dict[str, torch.nn.Module], _: pytest.MonkeyPatch) -> Case:
        target = CausalLM(m["target"])
        target.use_linear_backend(backend)
        return Case(model_decoder(target, CausalLM(m["draft"]), shape), target, checks=dict(branched=shape.max_nodes() > 3))

    return build


def _restricted_head(m: dict[str, torch.nn.Module], _: pytest.MonkeyPatch) -> Case:
    target, draft = CausalLM(m["target"]), CausalLM(m["draft"])
    draft.restrict_head(HEAD)
    assert draft.dims.vocab == V and HEAD < V

    def tokens_beyond_head_come_from_residuals(exact: Exact, got: Sample) -> None:
        beyond = sum(p for cell, p in exact.items() if cell[1] >= HEAD)
        assert beyond > 0.15, f"the target gives tokens >= {HEAD} too little mass ({beyond:.3f}) at t2"
        assert sum(c for cell, c in got.counts.items() if cell[1] >= HEAD) > 0

    return Case(model_decoder(target, draft, CHAIN), target, extra=tokens_beyond_head_come_from_residuals)


def _prompt_lookup(m: dict[str, torch.nn.Module], _: pytest.MonkeyPatch) -> Case:
    target = CausalLM(m["target"])
    decoder = Decoder(target, PromptLookupDrafter(max_ngram=3, min_ngram=1), 3, verify_width=4)
    return Case(decoder, target, prompt=list(LOOKUP_PROMPT))


def _lookup_first(shape: TreeShape) -> Builder:
    """A draft model with ``lookup_first``: the first round starts from a copy where the prompt's
    trigram recurs - after a sampled 3 - and the model drafts otherwise; both kinds of round must
    have run. A chain checks the copy (kept tokens are still draws from the draft's q, see
    ``reuse_or_draw``); a tree drafts the copy alone (one-hot q)."""
    def build(m: dict[str, torch.nn.Module], _: pytest.MonkeyPatch) -> Case:
        target = CausalLM(m["target"])
        drafter = ModelDrafter(CausalLM(m["draft"]), target.dims.vocab, shape, lookup_first=True)
        decoder = Decoder(target, drafter, len(shape.widths), verify_width=shape.max_nodes() + 1)

        def both_kinds_of_round(exact: Exact, got: Sample) -> None:
            assert 0 < drafter.lookup_rounds < got.stats.draft_rounds, (drafter.lookup_rounds, got.stats.draft_rounds)
            if drafter.checks_copies:
                assert drafter.copied_kept > 0  # the check kept copied tokens
            else:
                assert drafter.copied_kept == 0

        return Case(decoder, target, prompt=list(LOOKUP_PROMPT), extra=both_kinds_of_round,
                    checks=dict(branched=not drafter.checks_copies))

    return build


def _packed_verify(m: dict[str, torch.nn.Module], _: pytest.MonkeyPatch) -> Case:
    if not mkl_packing_available():
        pytest.skip("runtime.linear.mkl_packing_available() is False: this torch build has no MKL packed GEMM")
    target = CausalLM(m["target"])
    target.use_linear_backend("mkl-packed", PACKED_TREE.max_nodes() + 1)  # the verify pass's width
    decoder = model_decoder(target, CausalLM(m["draft"]), PACKED_TREE)
    return Case(decoder, CausalLM(m["target"]), checks=dict(branched=True))  # dense reference


def _chain_through_tree_verifier(m: dict[str, torch.nn.Module], monkeypatch: pytest.MonkeyPatch) -> Case:
    """The decoder sends chains to the chain verifier; here every draft is declared a tree, so
    ``Decoder._verify_tree`` (tree mask, depth positions, ``accept_tree``, cache path commit)
    verifies width-1 chains. Call counters prove which verifier ran."""
    calls = {"tree": 0, "chain": 0}

    def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any) -> Any:
            calls[name] += 1
            return fn(*args)

        return wrapper

    monkeypatch.setattr(Draft, "is_chain", property(lambda self: False))
    monkeypatch.setattr(runtime.decoding, "accept_tree", counted("tree", runtime.decoding.accept_tree))
    monkeypatch.setattr(runtime.decoding, "accept_chain", counted("chain", runtime.decoding.accept_chain))
    def only_the_tree_verifier_ran(exact: Exact, got: Sample) -> None:
        assert calls["tree"] >= got.stats.draft_rounds > 0 and calls["chain"] == 0, calls

    case = _draft_case(CHAIN)(m, monkeypatch)
    case.extra = only_the_tree_verifier_ran
    return case


class InBatch:
    """Decodes its prompt continuously batched beside a batch-mate (a tree-drafting sequence over
    another prompt, with its own seed): every round of the sequence counted is a batched step
    (``runtime.batching.batch_round``: one target forward over both, per-sequence acceptance)."""

    MATE_PROMPT = [4, 0, 2, 2, 1, 3, 0, 1, 4]

    def __init__(self, decoder: Decoder, mate: Callable[[], Decoder]) -> None:
        self.decoder, self.mate = decoder, mate

    @property
    def drafter(self) -> Any:  # sample_joint records the drafts through this
        return self.decoder.drafter

    @drafter.setter
    def drafter(self, value: Any) -> None:
        self.decoder.drafter = value

    def generate(self, prompt: list[int], config: GenerationConfig, before_round: Any = None) -> Any:
        mate_decoder = self.mate()
        mate_config = GenerationConfig(max_new_tokens=config.max_new_tokens + 8, sampling=config.sampling,
                                       seed=config.seed + 1000)
        with torch.inference_mode():
            me = Member(self.decoder, self.decoder.start(prompt, config))
            mate = Member(mate_decoder, mate_decoder.start(self.MATE_PROMPT, mate_config))
        while not me.seq.finished:
            if before_round is not None:
                before_round(self.decoder, prompt + me.seq.out, me.seq.cache, me.seq.stats)
            assert not mate.seq.finished, "the batch-mate ended first: the round would not be batched"
            batch_round(self.decoder.target, [me, mate])
        return me.seq.result()


def _batched(shape: TreeShape) -> Builder:
    def build(m: dict[str, torch.nn.Module], _: pytest.MonkeyPatch) -> Case:
        target = CausalLM(m["target"])
        mate = lambda: model_decoder(CausalLM(m["target"]), CausalLM(m["draft"]), TREE)  # noqa: E731
        decoder = InBatch(model_decoder(target, CausalLM(m["draft"]), shape), mate)
        return Case(decoder, target, checks=dict(branched=shape.max_nodes() > len(shape.widths)))  # type: ignore[arg-type]

    return build


class Switching:
    """Decodes its prompt switching strategy between rounds, as the per-request controller does
    (``autotune.tuning.controller``: ``Decoder.apply`` before a round): a one-token draft-model
    chain, then prompt lookup, then plain decoding, in turn. Most seeds switch inside the
    counted tokens (the first round's one-token draft is often rejected)."""

    ORDER = (Strategy(drafter="draft-model", draft_length=1, confidence_threshold=0.0),
             Strategy(drafter="prompt-lookup", draft_length=3), PLAIN)

    def __init__(self, decoder: Decoder) -> None:
        self.decoder = decoder
        self.drafter: Any = decoder.drafter  # sample_joint's recorder wraps this one, not the switching ones
        self.kinds: list[str] = []  # the drafter kind of every round decoded

    def generate(self, prompt: list[int], config: GenerationConfig, before_round: Any = None) -> Any:
        self.decoder.apply(self.ORDER[0])
        rounds = 0

        def switch(dec: Decoder, tokens: list[int], cache: Any, stats: Any) -> None:
            nonlocal rounds
            if before_round is not None:
                before_round(dec, tokens, cache, stats)  # the harness stops once the counted tokens exist
            dec.apply(self.ORDER[rounds % len(self.ORDER)])
            self.kinds.append(dec.kind or "none")
            rounds += 1

        return self.decoder.generate(prompt, config, before_round=switch)


def _switching(m: dict[str, torch.nn.Module], _: pytest.MonkeyPatch) -> Case:
    target = CausalLM(m["target"])
    decoder = Decoder(target, ModelDrafter(CausalLM(m["draft"]), target.dims.vocab, TreeShape((1,))), 1,
                      verify_width=4, kind="draft-model")
    decoder.standby["prompt-lookup"] = PromptLookupDrafter(max_ngram=3, min_ngram=1)
    switching = Switching(decoder)

    def switched_mid_request(exact: Exact, got: Sample) -> None:
        assert {"draft-model", "prompt-lookup"} <= set(switching.kinds)
        assert switching.kinds.count("prompt-lookup") > 100, "few seeds reached the switch inside the counted tokens"

    return Case(switching, target, prompt=list(LOOKUP_PROMPT), extra=switched_mid_request)  # type: ignore[arg-type]


MODES: dict[str, Builder] = {
    "chain": _draft_case(CHAIN),
    "tree-3-2-1": _draft_case(TREE, branched=True),
    "tree-threshold": _draft_case(THRESHOLD, branched=True, full_shape=THRESHOLD),
    "swift-dynamic-widths": _draft_case(DYNAMIC, branched=True),
    "tree-top-k-top-p-t0.7": _draft_case(TREE, TRUNCATED, branched=True),
    "easyspec-calibrated": _easyspec(calibrate=True),
    "easyspec-uncalibrated": _easyspec(calibrate=False),
    "self-draft-skip": _self_draft,
    "int8-draft": _int8_draft,
    "int4-target-chain": _quantised_target("int4", CHAIN),
    "w8a8-target-tree": _quantised_target("w8a8", TREE),
    "gguf-target-chain": _quantised_target("gguf", CHAIN),
    "restricted-draft-head": _restricted_head,
    "prompt-lookup": _prompt_lookup,
    "lookup-first-draft-model": _lookup_first(CHAIN),
    "lookup-first-tree": _lookup_first(TREE),
    "packed-verify": _packed_verify,
    "chain-through-tree-verifier": _chain_through_tree_verifier,
    "batched-chain": _batched(CHAIN),
    "batched-tree": _batched(TREE),
    "switch-between-rounds": _switching,
}


def _run(case: Case) -> tuple[Exact, Sample]:
    exact = exact_joint(case.reference, case.prompt, case.params)
    return exact, sample_joint(case.decoder, case.prompt, case.params, case.depth)


@pytest.mark.parametrize("mode", list(MODES))
def test_speculative_sampling_reproduces_target_distribution(mode, models, monkeypatch):
    case = MODES[mode](models, monkeypatch)
    exact, got = _run(case)
    check_speculated(got, **case.checks)
    if case.params.top_k or case.params.top_p < 1.0:  # truncation: the zero-count check has cells
        assert any(p == 0.0 for p in exact.values())
    if case.extra is not None:
        case.extra(exact, got)
    assert_matches_target(exact, got)


# ---------------------------------------------------------------- power: wrong rules must fail
def _accept_every_draft(p: torch.Tensor, q: torch.Tensor | None, tokens: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """``accept_chain`` that keeps every draft token whatever p and q say, then the bonus."""
    k = int(tokens.shape[0])
    return torch.tensor([k, *tokens.tolist(), int(sample(p[k], gen))])


_accept_tree = runtime.tree_verify.accept_tree


def _rows_off_by_one(
    p: torch.Tensor, tree: CompiledTree, tokens: torch.Tensor, q: torch.Tensor | None, gen: torch.Generator
) -> torch.Tensor:
    """``accept_tree`` fed misaligned target rows: node ``i``'s children are checked against the
    row of node ``i - 1`` (the root's stay right), as an indexing slip would do."""
    return _accept_tree(torch.cat([p[:1], p[:-1]]), tree, tokens, q, gen)


# name -> (shape drafted, module whose global the decoder looks up, that name, the wrong rule)
MUTANTS: dict[str, tuple[TreeShape, ModuleType, str, Callable[..., Any]]] = {
    "accept-every-draft": (CHAIN, runtime.decoding, "accept_chain", _accept_every_draft),
    "resample-from-p-not-residual": (CHAIN, runtime.sampling, "residual", lambda p, q: p),
    "tree-keeps-rejected-child-q": (TREE, runtime.tree_verify, "residual", lambda p, q: p),
    "tree-target-rows-off-by-one": (TREE, runtime.decoding, "accept_tree", _rows_off_by_one),
}


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_harness_rejects_a_wrong_acceptance_rule(mutant, models, monkeypatch):
    """The same harness, with a deliberately wrong rule patched where the decoder looks it up,
    must reject: otherwise a passing distribution test proves nothing."""
    shape, module, name, wrong = MUTANTS[mutant]
    monkeypatch.setattr(module, name, wrong)
    exact, got = _run(_draft_case(shape)(models, monkeypatch))
    assert got.stats.drafted > 0
    result = chi_square(exact, got.counts)
    assert result.pvalue < ALPHA or result.impossible, f"{mutant} went unnoticed: {result}"


def test_harness_rejects_a_wrong_rule_in_a_batch(models, monkeypatch):
    """Power check of the batched case: accepting every draft inside a batched step is caught."""
    monkeypatch.setattr(runtime.decoding, "accept_chain", _accept_every_draft)
    exact, got = _run(_batched(CHAIN)(models, monkeypatch))
    assert got.stats.drafted > 0
    result = chi_square(exact, got.counts)
    assert result.pvalue < ALPHA or result.impossible, f"a wrong rule in a batch went unnoticed: {result}"


def test_harness_rejects_a_lookup_check_that_always_keeps_the_copy(models, monkeypatch):
    """A chain's lookup check that keeps every copied token (yet reports the draft's q, as the
    correct check may) proposes tokens not drawn from q: the harness must reject it."""
    monkeypatch.setattr(runtime.chain_drafting, "reuse_or_draw", lambda q, proposed, gen: (proposed, True))
    case = _lookup_first(CHAIN)(models, monkeypatch)
    exact, got = _run(case)
    assert got.stats.drafted > 0 and case.decoder.drafter.lookup_rounds > 0
    result = chi_square(exact, got.counts)
    assert result.pvalue < ALPHA or result.impossible, f"an always-kept copy went unnoticed: {result}"


def test_harness_rejects_a_wrong_rule_across_switches(models, monkeypatch):
    """Power check of the switching case: accepting every draft, in rounds of either drafter, is caught."""
    monkeypatch.setattr(runtime.decoding, "accept_chain", _accept_every_draft)
    exact, got = _run(_switching(models, monkeypatch))
    assert got.stats.drafted > 0
    result = chi_square(exact, got.counts)
    assert result.pvalue < ALPHA or result.impossible, f"a wrong rule across switches went unnoticed: {result}"
