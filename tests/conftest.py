"""Shared fixtures: tiny random-weight models (fast unit tier) and real packaged models (slow tier)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from runtime.testing import tiny_model

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"

# ``--precision auto`` on the CPU is measured per machine (runtime.auto_precision); the suite pins it
# to int4 so that what the default path runs does not depend on the machine CI lands on (and no test
# server probes). tests/runtime/test_auto_precision.py exercises the measured choice itself.
os.environ.setdefault("AUTOTUNE_AUTO_PRECISION", "int4")


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
