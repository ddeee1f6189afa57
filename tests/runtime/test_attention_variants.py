"""Config features that change attention: sliding windows (Mistral, Qwen2) and scaled RoPE.

Our forward must equal HF's for every config it accepts, and refuse the ones it cannot match."""
from __future__ import annotations


import pytest
import torch

from runtime.decoding import Decoder, GenerationConfig
from runtime.drafters import ModelDrafter, SelfDrafter, TreeShape
from runtime.errors import RuntimeUserError
from runtime.layout import Layout
from runtime.testing import noisy_copy, tiny_model
from runtime.transformer import CausalLM
from runtime.tree import compile_tree, verify_mask
from search_spaces import LayerPlan

WINDOW = 4
PROMPT = [5, 17, 3, 88, 42, 7, 9, 61, 30, 2, 77, 14]  # 12 tokens: three windows' worth
COMMON = dict(
    vocab_size=96, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=512, tie_word_embeddings=False,
)


def _sharpen(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():  # as runtime.testing.tiny_model: no greedy near-ties
        model.lm_head.weight.mul_(8.0)
    return model.eval()


def windowed_model(family: str, seed: int, layers: int = 4, window: int = WINDOW) -> torch.nn.Module:
    """Mistral: every layer windowed; Qwen2: layers >= max_window_layers=2 windowed, 0 and 1 full."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    if family == "mistral":
        model = MistralForCausalLM(MistralConfig(**COMMON, num_hidden_layers=layers, sliding_window=window))
    else:
        cfg = Qwen2Config(
            **COMMON, num_hidden_layers=layers, use_sliding_window=True, sliding_window=window, max_window_layers=2
        )
        model = Qwen2ForCausalLM(cfg)
    return _sharpen(model)


def rope_llama(seed: int, **rope: object) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return _sharpen(LlamaForCausalLM(LlamaConfig(**COMMON, num_hidden_layers=2, **rope)))


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def chunked_logits(lm: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    """Prefill (causal fast path), one decode step (no mask), then a chunk over a cache (explicit mask)."""
    cache = lm.new_cache(64)
    with torch.inference_mode():
        return torch.cat([lm(ids[:9], cache), lm(ids[9:10], cache), lm(ids[10:], cache)])


# ---------------------------------------------------------------- sliding windows
def test_which_layers_are_windowed():
    assert CausalLM(windowed_model("mistral", 0)).windows == (WINDOW,) * 4
    assert CausalLM(windowed_model("qwen2", 0)).windows == (None, None, WINDOW, WINDOW)
    # full-attention models carry no window state at all (no per-forward mask work)
    assert CausalLM(tiny_model("llama", 0)).windows is None
    assert CausalLM(tiny_model("qwen2", 0)).windows is None  # use_sliding_window defaults to False


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_windowed_logits_match_hf(family):
    model = windowed_model(family, 10)
    ids = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ref = model(ids[None]).logits[0]
        lm = CausalLM(model)
        prefill = lm(ids, lm.new_cache(64))
    torch.testing.assert_close(prefill, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(chunked_logits(lm, ids), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_windowed_greedy_equals_hf_generate(family):
    model = windowed_model(family, 11)
    ours = Decoder(CausalLM(model)).generate(PROMPT, GenerationConfig(max_new_tokens=24))
    assert ours.tokens == hf_greedy(model, PROMPT, 24)


@pytest.mark.parametrize(
    "family, shape, window",
    [
        ("mistral", TreeShape((1, 1, 1)), WINDOW),
        ("mistral", TreeShape((2, 2, 1)), WINDOW),
        ("qwen2", TreeShape((2, 2, 1)), WINDOW),
        ("qwen2", TreeShape((2, 2, 1)), 2),
    ],
    ids=["mistral-chain", "mistral-tree", "qwen2-tree", "qwen2-tree-deeper-than-window"],
)
def test_windowed_speculation_equals_plain(family, shape, window):
    """Lossless with windows, also when the tree is deeper than the window (window 2): the draft's
    own frontier forwards then see a far ancestor or two too many, which moves acceptance only."""
    target_hf = windowed_model(family, 12, window=window)
    target = CausalLM(target_hf)
    cfg = GenerationConfig(max_new_tokens=24)
    plain = Decoder(target).generate(PROMPT, cfg)
    drafter = ModelDrafter(CausalLM(noisy_copy(target_hf, 0.3, 1)), target.dims.vocab, shape)
    spec = Decoder(target, drafter, len(shape.widths), verify_width=shape.max_nodes() + 1).generate(PROMPT, cfg)
    assert spec.tokens == plain.tokens
    assert spec.stats.mean_accepted > 1.0  # drafts were accepted: committed tree paths crossed windows


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_tree_verify_rows_are_windowed_by_tree_position(family):
    """Every node of a tree verify forward (tree mask, depth positions; slots != positions) gets the
    logits a sequential forward of prefix + root + its path gives, with a window of 2 shallower
    than the tree (a second child's key must be hidden by its position, not its slot)."""
    lm = CausalLM(windowed_model(family, 14, window=2))
    prefix = torch.tensor(PROMPT[:10])
    parents = (-1, -1, 0, 1, 1, 4, 5)  # depths 1 1 2 2 2 3 4; the deep path runs through node 1
    tokens = torch.tensor([PROMPT[10], 40, 41, 42, 43, 44, 45, 46])  # root + 7 nodes
    tree = compile_tree(parents)
    base = len(prefix)
    with torch.inference_mode():
        cache = lm.new_cache(64)
        lm(prefix, cache)
        positions = torch.cat([torch.zeros(1, dtype=torch.long), tree.depth]) + base
        tree_logits = lm(tokens, cache, Layout.explicit(verify_mask(tree, base), positions))
        for node in range(tree.size):
            path = torch.cat([prefix, tokens[:1], tokens[1:][tree.path_to(node)]])
            ref = lm(path, lm.new_cache(64))[-1]
            torch.testing.assert_close(tree_logits[node + 1], ref, rtol=1e-4, atol=1e-4)


def test_windowed_layer_plans_equal_plain():
    """Qwen2 layers 0-1 full, 2-3 windowed: a group mixing both (batched and loop executors) and a
    self-drafter skipping a windowed layer keep decoding lossless and agree with each other."""
    target_hf = windowed_model("qwen2", 13, layers=4)
    target = CausalLM(target_hf)
    cfg = GenerationConfig(max_new_tokens=24)
    plain = Decoder(target).generate(PROMPT, cfg)
    shape = TreeShape((2, 2, 1))
    group = LayerPlan(4, groups=((1, 2),))
    draft = CausalLM(noisy_copy(target_hf, 0.2, 2))
    for executor in ("batched", "loop"):
        draft.group_executor = executor
        drafter = ModelDrafter(draft, target.dims.vocab, shape, plan=group)
        spec = Decoder(target, drafter, 3, verify_width=shape.max_nodes() + 1).generate(PROMPT, cfg)
        assert spec.tokens == plain.tokens
    selfspec = Decoder(target, SelfDrafter(target, LayerPlan(4, skip_attn=(2,)), shape), 3,
                       verify_width=shape.max_nodes() + 1).generate(PROMPT, cfg)
    assert selfspec.tokens == plain.tokens

    ids = torch.randint(0, 96, (30,), generator=torch.Generator().manual_seed(1))
    outs = []
    for executor in ("batched", "loop"):
        draft.group_executor = executor
        outs.append(chunked_logits_plan(draft, ids, group))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)
    # an identity plan through run_blocks (a recorder forces that path) equals the plain loop
    draft.recorder = _NullRecorder()
    via_blocks = chunked_logits(draft, ids)
    draft.recorder = None
    torch.testing.assert_close(via_blocks, chunked_logits(draft, ids))


def chunked_logits_plan(lm: CausalLM, ids: torch.Tensor, plan: LayerPlan) -> torch.Tensor:
    cache = lm.new_cache(64)
    with torch.inference_mode():
        return torch.cat([lm(ids[:9], cache, plan=plan), lm(ids[9:10], cache, plan=plan),
                          lm(ids[10:], cache, plan=plan)])


class _NullRecorder:
    def attn_input(self, li: int, h: torch.Tensor) -> None:
        pass

    def attn(self, li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
        pass


# ---------------------------------------------------------------- RoPE variants
STATIC_ROPE = {
    "linear": dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "llama3": dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
    }),
    "yarn": dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
}


@pytest.mark.parametrize("kind", sorted(STATIC_ROPE))
def test_static_scaled_rope_matches_hf(kind):
    model = rope_llama(20, **STATIC_ROPE[kind])
    rotary = model.model.rotary_emb
    assert rotary.rope_type == kind
    plain = rope_llama(20).model.rotary_emb
    # the variant really changes the table (else this test would prove nothing)
    assert not torch.allclose(rotary.inv_freq, plain.inv_freq) or rotary.attention_scaling != 1.0
    ids = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        ref = model(ids[None]).logits[0]
    lm = CausalLM(model)
    with torch.inference_mode():
        ours = lm(ids, lm.new_cache(64))
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(chunked_logits(lm, ids), ref, rtol=1e-4, atol=1e-4)


LENGTH_DEPENDENT_ROPE = {
    "dynamic": dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
    "longrope": dict(rope_scaling={
        "rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
        "original_max_position_embeddings": 128,
    }),
}


@pytest.mark.parametrize("kind", sorted(LENGTH_DEPENDENT_ROPE))
def test_length_dependent_rope_is_refused(kind):
    model = rope_llama(21, **LENGTH_DEPENDENT_ROPE[kind])
    with pytest.raises(RuntimeUserError, match=rf"rope_scaling\.rope_type='{kind}'.*rope_parameters.*not supported"):
        CausalLM(model)
