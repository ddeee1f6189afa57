"""The online tuner, matchness, cost model, persistence and CLI.

Public names are imported lazily (the CLI starts without loading optuna or torch)."""
from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "load_best_strategy": "autotune.resolve",
    "resolve_strategy": "autotune.resolve",
    "run_study": "autotune.study",
    "OnlineTuner": "autotune.tuner",
    "TunerSettings": "autotune.tuner",
    "MeasuredCostModel": "autotune.cost_model",
    "matchness": "autotune.matchness",
    "predict": "autotune.objective",
    "open_storage": "autotune.storage",
    "Storage": "autotune.storage",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'autotune' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
