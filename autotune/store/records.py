"""The values the strategy store reads and writes: keys, result metrics, stored rows.

Frozen and validated on construction (errors name the field); the store is ``autotune.store.storage``.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from autotune.errors import StorageError
from search_spaces.errors import StrategyError
from search_spaces.strategy import Strategy

# key column -> most characters stored
KEY_LIMITS: dict[str, int] = {"model_id": 1024, "model_revision": 255, "draft_id": 1024, "task": 255, "hardware": 512}
STUDY_NAME_LIMIT = 512  # as Optuna's own study_name column
# the prompts stored with a record (what a task router is fitted on): at most this many per record, the
# first ones given, each clipped to this many characters (its head and tail; see ``clip_prompt``)
PROMPTS_PER_RECORD = 64
PROMPT_CHARS = 4096
COST_SHAPE_LIMIT = 200  # autotune_costs.shape: what the kept timings were timed for, besides the key
_CLIP_JOIN = "\n...\n"


@dataclass(frozen=True)
class StrategyKey:
    """What a tuned strategy is for. ``draft_id`` is ``''`` when no draft model is used."""

    model_id: str
    model_revision: str
    draft_id: str
    task: str
    hardware: str

    def __post_init__(self) -> None:
        for name, limit in KEY_LIMITS.items():
            value = getattr(self, name)
            if not isinstance(value, str) or len(value) > limit:
                raise StorageError(f"StrategyKey.{name}={value!r} must be a string of at most {limit} characters")
        for name in ("model_id", "task", "hardware"):
            if not getattr(self, name):
                raise StorageError(f"StrategyKey.{name} must not be empty")

    def as_row(self) -> dict[str, str]:
        return asdict(self)

    def describe(self) -> str:
        draft = f" draft {self.draft_id}" if self.draft_id else ""
        return f"model {self.model_id} (revision {self.model_revision}){draft} task {self.task}"


@dataclass(frozen=True)
class ResultMetrics:
    """How a strategy did. ``score`` ranks results (higher is better; measured tokens/s is the
    natural score); ``tuning_share`` is the fraction of wall time spent tuning."""

    score: float
    measured_tps: float | None = None
    predicted_tps: float | None = None
    acceptance: float | None = None
    speedup: float | None = None
    tuning_share: float | None = None
    study_name: str | None = None

    def __post_init__(self) -> None:
        _check_number("score", self.score, -math.inf, math.inf)
        for name in ("measured_tps", "predicted_tps", "speedup"):
            _check_number(name, getattr(self, name), 0.0, math.inf, optional=True)
        for name in ("acceptance", "tuning_share"):
            _check_number(name, getattr(self, name), 0.0, 1.0, optional=True)
        name = self.study_name
        if name is not None and (not isinstance(name, str) or len(name) > STUDY_NAME_LIMIT):
            raise StorageError(f"ResultMetrics.study_name={name!r} must be a string of at most {STUDY_NAME_LIMIT} chars")

    @classmethod
    def from_throughput(cls, measured_tps: float, **rest: Any) -> "ResultMetrics":
        """Metrics scored by the measured tokens/s."""
        return cls(score=measured_tps, measured_tps=measured_tps, **rest)

    def as_row(self) -> dict[str, Any]:
        return {k: (float(v) if isinstance(v, (int, float)) else v) for k, v in asdict(self).items()}


def clip_prompt(text: str) -> str:
    """``text`` bounded to ``PROMPT_CHARS`` characters: its head and its tail around ``"\\n...\\n"``
    (an instruction may come first and the question last, as in few-shot prompts). NUL characters,
    which PostgreSQL's text type refuses, are dropped."""
    if not isinstance(text, str):
        raise TypeError(f"a stored prompt must be a string, got {type(text).__name__}")
    text = text.replace("\x00", "")
    if len(text) <= PROMPT_CHARS:
        return text
    keep = PROMPT_CHARS - len(_CLIP_JOIN)
    return text[: keep - keep // 2] + _CLIP_JOIN + text[len(text) - keep // 2:]


def bounded_prompts(prompts: Sequence[str]) -> list[str]:
    """The prompts a record stores: the first ``PROMPTS_PER_RECORD``, each through ``clip_prompt``."""
    if isinstance(prompts, str):
        raise TypeError("prompts must be a sequence of strings, not one string")
    return [clip_prompt(text) for text in list(prompts)[:PROMPTS_PER_RECORD]]


def _check_number(name: str, value: Any, lo: float, hi: float, optional: bool = False) -> None:
    if value is None and optional:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not lo <= value <= hi:
        raise StorageError(f"ResultMetrics.{name}={value!r} must be a finite number in [{lo}, {hi}]")


@dataclass(frozen=True)
class StoredStrategy:
    """A row of ``autotune_best``: the best strategy recorded for ``key``."""

    id: int
    key: StrategyKey
    strategy_json: str
    score: float
    measured_tps: float | None
    predicted_tps: float | None
    acceptance: float | None
    study_name: str | None
    history_id: int
    updated_at: datetime

    @property
    def strategy(self) -> Strategy:
        return _parse_stored(self.strategy_json, f"stored strategy {self.id}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("strategy_json")
        d["strategy"] = self.strategy.to_dict()
        d["updated_at"] = self.updated_at.isoformat()
        return d


@dataclass(frozen=True)
class HistoryEntry:
    """A row of ``autotune_history``: one recorded result."""

    id: int
    key: StrategyKey
    recorded_at: datetime
    strategy_json: str
    score: float
    measured_tps: float | None
    predicted_tps: float | None
    acceptance: float | None
    speedup: float | None
    tuning_share: float | None
    study_name: str | None

    @property
    def strategy(self) -> Strategy:
        return _parse_stored(self.strategy_json, f"history entry {self.id}")


def _parse_stored(text: str, what: str) -> Strategy:
    try:
        return Strategy.from_json(text)
    except StrategyError as exc:
        raise StrategyError(f"{what} cannot be read by this version: {exc}") from exc
