"""A stored strategy in another engine's terms.

Formats: ``json`` (our Strategy JSON: ``autotune generate --strategy FILE`` reads it back), ``hf``
(Hugging Face ``generate`` / ``generation_config`` fields) and ``vllm`` (a ``speculative_config``
dict). Engines cannot express everything we tune; those strategies are refused with an error naming
what is missing rather than exported as something that decodes differently.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from autotune.errors import ExportError

EXPORT_FORMATS = ("json", "hf", "vllm")


def export_strategy(stored: Any, fmt: str) -> tuple[Any, list[str]]:
    """A stored strategy in ``fmt`` -> (JSON-ready payload, notes on dropped speed-only settings).

    Raises ``ExportError`` naming what ``fmt`` cannot express (self-speculation by layer skipping,
    layer plans, token trees, dynamic verification widths)."""
    if fmt not in EXPORTERS:
        raise ExportError(f"unknown export format '{fmt}'; choose one of {', '.join(EXPORT_FORMATS)}")
    strategy = stored.strategy
    if fmt != "json":
        missing = _inexpressible(strategy)
        if missing:
            raise ExportError(
                f"strategy {stored.id} cannot be exported as {fmt}: {fmt} has no equivalent of {'; '.join(missing)}; "
                "use --format json and `autotune generate --strategy FILE` instead"
            )
        if strategy.drafter == "draft-model" and not stored.key.draft_id:
            raise ExportError(
                f"strategy {stored.id} uses a draft model but none was stored with it; cannot export as {fmt}"
            )
    return EXPORTERS[fmt](strategy, stored.key.draft_id)


def _inexpressible(strategy: Any) -> list[str]:
    missing = []
    if strategy.drafter == "layer-skip":
        missing.append("drafter 'layer-skip' (the target drafting for itself with skipped layers)")
    plan = strategy.layer_plan
    if plan is not None and strategy.drafter != "layer-skip":
        what = "parallel layer groups" if plan.groups else "skipped draft sub-layers"
        missing.append(f"a layer plan ({what})")
    if strategy.tree_widths is not None:
        missing.append(f"token trees (tree_widths={list(strategy.tree_widths)})")
    if strategy.dynamic_widths is not None:
        missing.append("dynamic verification widths (dynamic_widths)")
    return missing


def _dropped(fmt: str, strategy: Any, names: tuple[str, ...]) -> list[str]:
    """Speed-only settings ``fmt`` cannot carry (leaving them out keeps the output lossless)."""
    from search_spaces.strategy import Strategy

    defaults = {"draft_vocab": None, "draft_precision": Strategy.draft_precision, "confidence_threshold": 0.0}
    dropped = [f"{n}={getattr(strategy, n)}" for n in names if getattr(strategy, n) != defaults[n]]
    if not dropped:
        return []
    return [f"{fmt} has no equivalent of {', '.join(dropped)}; exported without (output unchanged, speed may differ)"]


def _lookup_ngrams() -> tuple[int, int]:
    """The runtime prompt-lookup drafter's (max, min) n-gram sizes (its defaults, read, not copied)."""
    from runtime.lookup import PromptLookupDrafter

    params = inspect.signature(PromptLookupDrafter).parameters
    return params["max_ngram"].default, params["min_ngram"].default


def _to_hf(strategy: Any, draft_id: str) -> tuple[Any, list[str]]:
    if strategy.drafter == "none":
        return {}, []
    if strategy.drafter == "prompt-lookup":
        high, low = _lookup_ngrams()
        dropped = [] if low <= 1 else [
            f"hf has no minimum matching n-gram (ours: {low}; it also copies after shorter matches); "
            "exported without (output unchanged, speed may differ)"
        ]
        return {"prompt_lookup_num_tokens": strategy.draft_length, "max_matching_ngram_size": high}, dropped
    config = {
        "assistant_model": draft_id, "num_assistant_tokens": strategy.draft_length,
        "num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": strategy.confidence_threshold,
    }
    return config, _dropped("hf", strategy, ("draft_vocab", "draft_precision"))


def _to_vllm(strategy: Any, draft_id: str) -> tuple[Any, list[str]]:
    if strategy.drafter == "none":
        return None, []
    if strategy.drafter == "prompt-lookup":
        high, low = _lookup_ngrams()
        config = {
            "method": "ngram", "num_speculative_tokens": strategy.draft_length,
            "prompt_lookup_max": high, "prompt_lookup_min": low,
        }
        return config, []
    config = {"model": draft_id, "num_speculative_tokens": strategy.draft_length}
    return config, _dropped("vllm", strategy, ("draft_vocab", "draft_precision", "confidence_threshold"))


EXPORTERS: dict[str, Callable[[Any, str], tuple[Any, list[str]]]] = {
    "json": lambda strategy, draft_id: (strategy.to_dict(), []),
    "hf": _to_hf,
    "vllm": _to_vllm,
}
