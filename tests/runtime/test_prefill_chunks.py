"""A long prompt is prefilled in chunks (``GenerationConfig.prefill_chunk``; a server steps its batch
between them): the chunks build the cache one forward over the whole prompt builds, and every
decoding mode stays token-identical to plain decoding under the same chunking."""
from __future__ import annotations

import pytest
import torch

from runtime.decoding import Decoder, GenerationConfig
from runtime.drafters import ModelDrafter, SelfDrafter, TreeShape
from runtime.errors import RuntimeUserError
from runtime.layout import Layout
from runtime.linear import BACKEND_AVAILABLE
from runtime.lookup import PromptLookupDrafter
from runtime.testing import noisy_copy, tiny_model
from runtime.transformer import CausalLM
from search_spaces.layer_plan import LayerPlan

PROMPT = [5, 17, 3, 88, 42, 7, 9, 61, 5, 17, 3, 88, 42, 11, 12, 5, 17, 3, 40, 2, 9]
BACKENDS = [b for b in ("dense", "onednn", "int4") if BACKEND_AVAILABLE[b]()]


def _target(backend: str = "dense", family: str = "qwen2") -> CausalLM:
    lm = CausalLM(tiny_model(family, 21, layers=4))
    lm.use_linear_backend(backend)
    return lm


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunk", [1, 4, 7])
def test_a_prompt_prefilled_in_chunks_builds_the_cache_of_one_forward(backend: str, chunk: int) -> None:
    lm = _target(backend)
    whole, parts = lm.new_cache(40), lm.new_cache(40)
    with torch.inference_mode():
        want = lm(torch.tensor(PROMPT), whole, logits_for=slice(-1, None))
        for at in range(0, len(PROMPT), chunk):
            got = lm(torch.tensor(PROMPT[at : at + chunk]), parts, Layout.chunk(), logits_for=slice(-1, None))
    n = len(PROMPT)
    assert parts.length == whole.length == n
    torch.testing.assert_close(parts.all_keys[:, :, :n], whole.all_keys[:, :, :n], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(parts.all_values[:, :, :n], whole.all_values[:, :, :n], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_chunk_that_saw_no_earlier_chunk_is_caught() -> None:
    """Power check: a later chunk must attend to the earlier ones (a fresh cache per chunk differs)."""
    lm = _target()
    whole = lm.new_cache(40)
    with torch.inference_mode():
        want = lm(torch.tensor(PROMPT), whole, logits_for=slice(-1, None))
        alone = lm(torch.tensor(PROMPT[14:]), lm.new_cache(40), Layout.chunk(), logits_for=slice(-1, None))
    assert not torch.allclose(alone, want, atol=1e-3)


def test_start_steps_yields_every_chunk_before_it_runs() -> None:
    dec = Decoder(_target())
    steps = dec.start_steps(PROMPT, GenerationConfig(max_new_tokens=4, prefill_chunk=8))
    seen = []
    chunk = next(steps)
    while True:
        assert chunk.part.cache.length == chunk.done - chunk.rows  # not run yet
        seen.append((chunk.rows, chunk.done, chunk.last))
        try:
            chunk = next(steps)
        except StopIteration as done:
            seq = done.value
            break
    assert seen == [(8, 8, False), (8, 16, False), (5, 21, True)]
    assert len(seq.out) == 1 and seq.cache.length == len(PROMPT) and seq.stats.target_forwards == 1
    one = Decoder(_target()).start(PROMPT, GenerationConfig(max_new_tokens=4))  # one chunk
    assert one.out == seq.out


def _modes(target: CausalLM) -> dict[str, Decoder]:
    draft = CausalLM(noisy_copy(target.hf_model, 0.3, seed=2))
    return {
        "chain": Decoder(target, ModelDrafter(draft, target.dims.vocab, TreeShape((1, 1, 1, 1))), 4, verify_width=5),
        "tree-3-2-1": Decoder(target, ModelDrafter(draft, target.dims.vocab, TreeShape((3, 2, 1))), 3, verify_width=10),
        "self-draft": Decoder(target, SelfDrafter(target, LayerPlan(n_layers=4, skip_mlp=(2,)), TreeShape((1, 1, 1))),
                              3, verify_width=4),
        "prompt-lookup": Decoder(target, PromptLookupDrafter(max_ngram=3), 4, verify_width=5),
    }


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_mode_equals_plain_decoding_under_chunked_prefill(backend: str) -> None:
    target = _target(backend)
    cfg = GenerationConfig(max_new_tokens=32, prefill_chunk=5)
    plain = Decoder(target).generate(PROMPT, cfg)
    for name, dec in _modes(target).items():
        got = dec.generate(PROMPT, cfg)
        assert got.tokens == plain.tokens, name
        assert got.stats.drafted > 0, name


@pytest.mark.parametrize("bad", [0, -3, True, 2.5])
def test_a_bad_prefill_chunk_is_a_clear_error(bad) -> None:
    with pytest.raises(RuntimeUserError, match="prefill_chunk"):
        GenerationConfig(prefill_chunk=bad)
