"""Shared fixtures: tiny random-weight models (fast unit tier) and real packaged models (slow tier)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from runtime.testing import tiny_model  # noqa: F401  (tests import it from here)

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


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
