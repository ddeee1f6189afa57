"""Shared fixtures: tiny random-weight models (fast unit tier) and real packaged models (slow tier)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def tiny_model(
    family: str, seed: int, vocab: int = 96, layers: int = 3, sharpen: float = 8.0
) -> torch.nn.Module:
    """A randomly initialised llama/qwen2 causal LM small enough for thousands of forwards.

    ``sharpen`` scales the output head: the default makes greedy paths clear of near-ties; the
    distribution tests use a milder scale so that sampled distributions stay spread."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    # sharpen the random logits so greedy paths are not near-ties and drafts sometimes agree
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


@pytest.fixture(scope="session")
def tiny_llama() -> torch.nn.Module:
    return tiny_model("llama", 0)


@pytest.fixture(scope="session")
def tiny_qwen() -> torch.nn.Module:
    return tiny_model("qwen2", 1)


@pytest.fixture(autouse=True, scope="session")
def _data_dir() -> None:
    os.environ.setdefault("AUTOTUNE_DATA_DIR", str(SHARED_DATA))


@pytest.fixture(scope="session")
def pool():
    from runtime.pipeline import ModelPool

    return ModelPool()


@pytest.fixture(scope="session")
def smollm(pool):
    return pool.get("smollm2-135m", "float32")
