"""Tiny random-weight models for checks that run without packaged weights (tests, torchrun scripts).

The tests and the scripts under ``runtime`` import them from here, so they build the same models.
"""
from __future__ import annotations

import torch


def tiny_model(
    family: str, seed: int, vocab: int = 96, layers: int = 3, sharpen: float = 8.0, hidden: int = 64
) -> torch.nn.Module:
    """A randomly initialised llama/qwen2 causal LM (qwen2: q/k/v biases), float32, eval mode.

    ``sharpen`` scales the output head: the default makes greedy paths clear of near-ties; the
    distribution tests use a milder scale so that sampled distributions stay spread. ``hidden`` is the
    model width (the MLP is twice it); 256 and up gives rows the k-quants (Q4_K) can hold."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        raise ValueError(f"tiny_model family must be 'llama' or 'qwen2', got {family!r}")
    # sharpen the random logits so greedy paths are not near-ties
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    return model.eval()


def noisy_copy(model: torch.nn.Module, scale: float, seed: int) -> torch.nn.Module:
    """A draft that mostly agrees with the target: its weights plus noise (greedy tests only; the
    distribution tests use independently seeded drafts)."""
    import copy

    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * scale * param.std())
    return draft
