"""Which strategy to decode with: ``--strategy best | default | PATH``.

- ``default``: the strategy built from the command-line flags (the dataclass defaults);
- ``best``: the stored best for (model id + revision, draft, task, this hardware);
- anything else: a JSON file as written by ``Strategy.to_json`` or ``autotune strategies export``.

A layer plan stored for another model depth is refused later by the runtime (``check_plan_fits``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from autotune.errors import StorageError
from autotune.store.hardware import hardware_fingerprint
from autotune.store.records import StrategyKey
from search_spaces.errors import StrategyError
from search_spaces.strategy import Strategy

BEST, DEFAULT = "best", "default"
PROMPT_TASK = "prompts"  # the task name of ad-hoc prompts (``generate --prompt``)


def strategy_key(target: Any, draft: str | None, task: str, device: str) -> StrategyKey:
    """The store key for a loaded target (``runtime.loading.LoadedModel``) on this machine."""
    return StrategyKey(
        model_id=target.model_id, model_revision=target.revision, draft_id=draft or "", task=task,
        hardware=hardware_fingerprint(device),
    )


def load_strategy_file(path: str | Path) -> Strategy:
    """A strategy JSON file; unreadable or invalid content raises ``StrategyError`` naming the file."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise StrategyError(
            f"cannot read strategy file {path}: {reason}; pass --strategy best, default or a JSON file path"
        ) from None
    try:
        return Strategy.from_json(text)
    except StrategyError as exc:
        raise StrategyError(f"strategy file {path}: {exc}") from None


def missing_best_message(model: str, task: str, draft: str | None, other_precisions: list[str] | None = None) -> str:
    with_draft = f" with draft {draft}" if draft else ""
    name = model.split("@", 1)[0]
    precision = _precision_of(model)
    if other_precisions:
        return (
            f"no tuned strategy stored for model {model}{with_draft} task {task} on this hardware at precision "
            f"{precision}, only at {', '.join(other_precisions)}; re-tune at this precision with `autotune study "
            f"--model {name} --task {task} --precision {precision}`, or pass --precision {other_precisions[0]}"
        )
    return (
        f"no tuned strategy stored for model {model}{with_draft} task {task} on this hardware; run "
        f"`autotune study --model {model} --task {task}` first, or pass --strategy default"
    )


def resolve_strategy(spec: str, storage: Any, key: StrategyKey, fallback: Strategy) -> Strategy:
    """``spec`` (best | default | PATH) -> the strategy. ``storage`` is a URL (None = the default
    store) or an open ``Storage``; it is only opened for ``best``."""
    if spec == DEFAULT:
        return fallback
    if spec != BEST:
        return load_strategy_file(spec)
    from autotune.store.storage import Storage, open_storage

    def lookup(opened: Any) -> tuple[Any, list[str]]:
        found = opened.best(key)
        return found, ([] if found is not None else other_precisions(opened, key))

    if isinstance(storage, Storage):
        found, others = lookup(storage)
    else:
        with open_storage(storage) as opened:
            found, others = lookup(opened)
    if found is None:
        raise StorageError(missing_best_message(key.model_id, key.task, key.draft_id, others))
    return found.strategy


def _precision_of(model_id: str) -> str:
    """The precision a model id names (``alias@rev#int4``), ``float32`` where it names none."""
    return model_id.split("#", 1)[1] if "#" in model_id else "float32"


def other_precisions(storage: Any, key: StrategyKey) -> list[str]:
    """Precisions at which ``key``'s model, draft and task have a stored strategy on this hardware
    (strategies are kept per precision: one tuned at another is never served at this one)."""
    base = key.model_id.split("#", 1)[0]
    rows = storage.list_best(task=key.task, draft_id=key.draft_id, hardware=key.hardware)
    return sorted({_precision_of(r.key.model_id) for r in rows
                   if r.key.model_id.split("#", 1)[0] == base and r.key.model_id != key.model_id})


def load_best_strategy(
    target: Any, task: str, draft: str | None = None, storage: Any = None, device: str = "cpu"
) -> Strategy:
    """Python API: the stored best strategy for a loaded target (``runtime.loading.LoadedModel``),
    ``task`` and ``draft`` on this hardware; ``StorageError`` when none is stored."""
    return resolve_strategy(BEST, storage, strategy_key(target, draft, task, device), fallback=Strategy())


def check_strategy_spec(
    spec: str, storage_url: str | None, model: str, draft: str | None, task: str, device: str
) -> None:
    """Fail before any model loads: a PATH must hold a valid strategy; ``best`` needs a reachable
    store holding a strategy for this task, draft and hardware (the exact model is checked once loaded)."""
    if spec == DEFAULT:
        return
    if spec != BEST:
        load_strategy_file(spec)
        return
    from autotune.store.storage import open_storage

    with open_storage(storage_url) as storage:
        candidates = storage.list_best(task=task, draft_id=draft or "", hardware=hardware_fingerprint(device))
    if not candidates:
        raise StorageError(missing_best_message(model, task, draft))
