"""The online tuner, matchness, cost model, persistence and CLI.

Public names are imported lazily (the CLI starts without loading optuna or torch)."""
from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "load_best_strategy": "autotune.store.resolve",
    "resolve_strategy": "autotune.store.resolve",
    "run_study": "autotune.tuning.study",
    "OnlineTuner": "autotune.tuning.tuner",
    "TunerSettings": "autotune.tuning.tuner",
    "MeasuredCostModel": "autotune.tuning.cost_model",
    "matchness": "autotune.tuning.matchness",
    "predict": "autotune.tuning.objective",
    "open_storage": "autotune.store.storage",
    "Storage": "autotune.store.storage",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'autotune' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
