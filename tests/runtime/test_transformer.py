"""Our forward pass equals the HF forward; plain greedy equals HF generate."""
import pytest
import torch

from runtime.decoding import Decoder, GenerationConfig
from runtime.errors import RuntimeUserError
from runtime.transformer import CausalLM


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen"])
def test_forward_matches_hf(family, request):
    model = request.getfixturevalue(family)
    lm = CausalLM(model)
    ids = torch.randint(0, 96, (17,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ref = model(ids[None]).logits[0]
        cache = lm.new_cache(32)
        ours = torch.cat([lm(ids[:9], cache), lm(ids[9:10], cache), lm(ids[10:], cache)])
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen"])
def test_plain_greedy_equals_hf_generate(family, request):
    model = request.getfixturevalue(family)
    prompt = [5, 17, 3, 88, 42]
    with torch.inference_mode():
        hf = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                            attention_mask=torch.ones(1, 5, dtype=torch.long), pad_token_id=0, eos_token_id=None)
    ours = Decoder(CausalLM(model)).generate(prompt, GenerationConfig(max_new_tokens=24))
    assert ours.tokens == hf[0, 5:].tolist()
    assert ours.stats.new_tokens == 24 and ours.stats.mean_accepted == 1.0


def test_unsupported_family_is_a_clear_error():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32))
    with pytest.raises(RuntimeUserError, match="supported: llama, mistral, qwen2"):
        CausalLM(model)


def test_prompt_longer_than_context_is_refused(tiny_llama):
    decoder = Decoder(CausalLM(tiny_llama))
    with pytest.raises(RuntimeUserError, match="exceeds the model context of 512"):
        decoder.generate(list(range(90)) * 6, GenerationConfig(max_new_tokens=4))
    with pytest.raises(RuntimeUserError, match="max_new_tokens"):
        GenerationConfig(max_new_tokens=0)
