"""Speculative decoding with a draft model is lossless: greedy token-identical (the sampled
distribution is checked exactly in test_distribution.py)."""
from __future__ import annotations


import pytest
import torch

from runtime.decoding import Decoder, GenerationConfig
from runtime.drafters import ModelDrafter, TreeShape
from runtime.sampling import SamplingParams
from runtime.testing import noisy_copy, tiny_model
from runtime.transformer import CausalLM

PROMPT = [5, 17, 3, 88, 42, 7]


def spec_decoder(target, draft, k: int, draft_backend: str = "dense", head: int | None = None,
                 verify_backend: str = "dense", threshold: float = 0.0, shape: TreeShape | None = None) -> Decoder:
    t, d = CausalLM(target), CausalLM(draft)
    d.restrict_head(head)
    d.use_linear_backend(draft_backend)
    shape = shape or TreeShape((1,) * k, threshold=threshold)
    width = shape.max_nodes() + 1
    if verify_backend != "dense":
        t.use_linear_backend(verify_backend, width)
    drafter = ModelDrafter(d, target_vocab=t.dims.vocab, shape=shape)
    return Decoder(t, drafter, len(shape.widths), verify_width=width)


TREES = [
    TreeShape((3, 2, 1)),
    TreeShape((2, 2, 2, 1), threshold=0.2),
    TreeShape((1, 1, 1, 1, 1), dynamic=((0.5, 4), (0.8, 2), (1.0, 1))),
    TreeShape((4,)),
]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("shape", TREES, ids=lambda s: f"{s.widths}-{s.dynamic}-{s.threshold}")
@pytest.mark.parametrize("verify_backend", ["dense", "mkl-packed"])
def test_greedy_tree_spec_equals_plain(family, shape, verify_backend):
    target, draft = tiny_model(family, 30), tiny_model(family, 31, layers=1)
    cfg = GenerationConfig(max_new_tokens=40)
    plain = Decoder(CausalLM(target)).generate(PROMPT, cfg)
    spec = spec_decoder(target, draft, 0, shape=shape, verify_backend=verify_backend).generate(PROMPT, cfg)
    assert spec.tokens == plain.tokens
    assert spec.stats.mean_tree_size > 1.0


def test_tree_raises_mean_accepted_over_chain(tiny_llama):
    draft = noisy_copy(tiny_llama, 0.8, seed=3)
    cfg = GenerationConfig(max_new_tokens=60)
    chain = spec_decoder(tiny_llama, draft, 3).generate(PROMPT, cfg)
    tree = spec_decoder(tiny_llama, draft, 0, shape=TreeShape((4, 2, 2))).generate(PROMPT, cfg)
    assert tree.tokens == chain.tokens
    assert tree.stats.mean_accepted > chain.stats.mean_accepted


def test_width_one_tree_verifies_like_a_chain(tiny_qwen):
    """Forcing the tree verifier on a chain gives the chain verifier's result and cache (greedy;
    under sampling the two consume random numbers differently, so the decoder routes every
    width-1 tree through the chain verifier)."""
    draft_model = noisy_copy(tiny_qwen, 0.5, seed=4)
    for params in [SamplingParams()]:
        results = []
        for use_tree in (False, True):
            dec = spec_decoder(tiny_qwen, draft_model, 4)
            cache = dec.target.new_cache(64)
            with torch.inference_mode():
                dec.target(torch.tensor(PROMPT), cache)
                dec.drafter.begin(PROMPT, 64)
                gen = torch.Generator().manual_seed(5)
                draft = dec.drafter.propose(4, params, gen)
                verify = dec._verify_tree if use_tree else dec._verify_chain
                path, nxt = verify(PROMPT[-1], draft, cache, params, gen)
            results.append((path, nxt, cache.length, cache.view(0)[0].clone()))
        assert results[0][:3] == results[1][:3]
        torch.testing.assert_close(results[0][3], results[1][3])


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("draft_backend,head", [("dense", None), ("int8", None), ("dense", 48)])
def test_greedy_spec_equals_plain(family, k, draft_backend, head):
    target, draft = tiny_model(family, 10), tiny_model(family, 11, layers=1)
    cfg = GenerationConfig(max_new_tokens=40)
    plain = Decoder(CausalLM(target)).generate(PROMPT, cfg)
    spec = spec_decoder(target, draft, k, draft_backend, head).generate(PROMPT, cfg)
    assert spec.tokens == plain.tokens
    assert spec.stats.new_tokens == 40
    assert 0.0 <= spec.stats.acceptance_rate <= 1.0


@pytest.mark.parametrize("threshold", [0.3, 0.9])
def test_confidence_early_stop_stays_lossless(tiny_llama, threshold):
    cfg = GenerationConfig(max_new_tokens=40)
    plain = Decoder(CausalLM(tiny_llama)).generate(PROMPT, cfg)
    for draft in (tiny_llama, tiny_model("llama", 13, layers=1)):
        spec = spec_decoder(tiny_llama, draft, 6, threshold=threshold).generate(PROMPT, cfg)
        assert spec.tokens == plain.tokens
        assert spec.stats.drafted < 6 * (spec.stats.target_forwards - 1)  # some chains stopped early


@pytest.mark.parametrize("k", [2, 5])
def test_draft_equal_to_target_accepts_everything(tiny_llama, k):
    """The all-accepted path (bonus token, draft KV catch-up) stays exact."""
    cfg = GenerationConfig(max_new_tokens=37)
    plain = Decoder(CausalLM(tiny_llama)).generate(PROMPT, cfg)
    spec = spec_decoder(tiny_llama, tiny_llama, k).generate(PROMPT, cfg)
    assert spec.tokens == plain.tokens
    assert spec.stats.acceptance_rate == 1.0
    assert spec.stats.mean_accepted > 2.0
    assert spec.stats.accept_hist[-1] > 0  # some rounds accepted all k drafts


def test_packed_verify_and_eos_truncation(tiny_qwen):
    draft = tiny_model("qwen2", 12, layers=1)
    plain = Decoder(CausalLM(tiny_qwen)).generate(PROMPT, GenerationConfig(max_new_tokens=30))
    eos = plain.tokens[17]
    cfg = GenerationConfig(max_new_tokens=30, eos_token_ids=(eos,))
    want = plain.tokens[: plain.tokens.index(eos) + 1]
    for backend in ["dense", "mkl-packed"]:
        spec = spec_decoder(tiny_qwen, draft, 4, verify_backend=backend).generate(PROMPT, cfg)
        assert spec.tokens == want, backend


def test_the_draft_models_prompt_is_prefill_not_a_round():
    """The draft model runs the prompt before the first round (timed as prefill, as the target's
    prompt is): a round's draft time is its own drafting only. Output stays plain decoding's."""
    target = tiny_model("llama", 30)
    dec = spec_decoder(target, noisy_copy(target, 0.1, seed=2), k=3)
    prompt = PROMPT * 4
    held = []
    out = dec.generate(prompt, GenerationConfig(max_new_tokens=24),
                       before_round=lambda d, tokens, cache, stats: held.append(d.drafter.cache.length))
    assert out.tokens == Decoder(CausalLM(target)).generate(prompt, GenerationConfig(max_new_tokens=24)).tokens
    assert out.stats.drafted > 0
    assert held[0] == len(prompt)  # before the first round: every prompt token but the newest is the draft's
    assert out.stats.prefill_s > 0
