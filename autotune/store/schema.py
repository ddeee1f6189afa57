"""The store's tables (SQLAlchemy Core) and how their rows become records.

- ``autotune_best``: one row per ``StrategyKey`` (model id + revision, draft id, task, hardware):
  the strategy JSON with the highest ``score`` recorded for the key and its metrics.
- ``autotune_history``: every result ever recorded (append only).
- ``autotune_prompts``: the prompts a result was tuned on (its routing texts, in order; at most
  ``PROMPTS_PER_RECORD``, each clipped to ``PROMPT_CHARS``), by history row.
- ``autotune_costs``: the tuner's cost-model timings (``MeasuredCostModel.timings``) per model
  (its id carries the precision), draft, hardware and ``shape`` (verify width, padding, the
  drafting model's backend): they depend on those, not on the prompts, so a study starts
  scoring at its first window instead of timing them again.
"""
from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    Column, DateTime, Float, Index, Integer, MetaData, String, Table, Text, UniqueConstraint, and_,
)

from autotune.store.records import COST_SHAPE_LIMIT, KEY_LIMITS, STUDY_NAME_LIMIT, HistoryEntry, StoredStrategy, StrategyKey

metadata = MetaData()


def _key_columns() -> list[Column]:
    return [Column(name, String(limit), nullable=False) for name, limit in KEY_LIMITS.items()]


best_table = Table(
    "autotune_best", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    *_key_columns(),
    Column("strategy", Text, nullable=False),
    Column("score", Float, nullable=False),
    Column("measured_tps", Float),
    Column("predicted_tps", Float),
    Column("acceptance", Float),
    Column("study_name", String(STUDY_NAME_LIMIT)),
    Column("history_id", Integer, nullable=False),  # the autotune_history row this best came from
    Column("updated_at", DateTime, nullable=False),  # UTC
    UniqueConstraint(*KEY_LIMITS, name="uq_autotune_best_key"),
)

history_table = Table(
    "autotune_history", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    *_key_columns(),
    Column("recorded_at", DateTime, nullable=False),  # UTC
    Column("strategy", Text, nullable=False),
    Column("score", Float, nullable=False),
    Column("measured_tps", Float),
    Column("predicted_tps", Float),
    Column("acceptance", Float),
    Column("speedup", Float),
    Column("tuning_share", Float),
    Column("study_name", String(STUDY_NAME_LIMIT)),
    Index("ix_autotune_history_key", *KEY_LIMITS),
)

prompts_table = Table(
    "autotune_prompts", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("history_id", Integer, nullable=False, index=True),  # the autotune_history row it was tuned for
    Column("position", Integer, nullable=False),  # order within the record
    Column("text", Text, nullable=False),
)


costs_table = Table(
    "autotune_costs", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("model_id", String(KEY_LIMITS["model_id"]), nullable=False),
    Column("model_revision", String(KEY_LIMITS["model_revision"]), nullable=False),
    Column("draft_id", String(KEY_LIMITS["draft_id"]), nullable=False),
    Column("hardware", String(KEY_LIMITS["hardware"]), nullable=False),
    Column("shape", String(COST_SHAPE_LIMIT), nullable=False),
    Column("timings", Text, nullable=False),  # JSON
    Column("updated_at", DateTime, nullable=False),  # UTC
    UniqueConstraint("model_id", "model_revision", "draft_id", "hardware", "shape", name="uq_autotune_costs_key"),
)


def utcnow() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


def row_key(row: Any) -> StrategyKey:
    return StrategyKey(**{name: getattr(row, name) for name in KEY_LIMITS})


def stored_from_row(row: Any) -> StoredStrategy:
    return StoredStrategy(
        id=row.id, key=row_key(row), strategy_json=row.strategy, score=row.score, measured_tps=row.measured_tps,
        predicted_tps=row.predicted_tps, acceptance=row.acceptance, study_name=row.study_name,
        history_id=row.history_id, updated_at=row.updated_at.replace(tzinfo=timezone.utc),
    )


def entry_from_row(row: Any) -> HistoryEntry:
    return HistoryEntry(
        id=row.id, key=row_key(row), recorded_at=row.recorded_at.replace(tzinfo=timezone.utc),
        strategy_json=row.strategy, score=row.score, measured_tps=row.measured_tps, predicted_tps=row.predicted_tps,
        acceptance=row.acceptance, speedup=row.speedup, tuning_share=row.tuning_share, study_name=row.study_name,
    )


def key_match(table: Table, key: StrategyKey) -> Any:
    return and_(*(table.c[name] == value for name, value in key.as_row().items()))


def scope(table: Table, model_id: str, model_revision: str, draft_id: str, hardware: str) -> Any:
    """Rows of one model / draft / hardware, any task."""
    values = dict(model_id=model_id, model_revision=model_revision, draft_id=draft_id, hardware=hardware)
    return and_(*(table.c[name] == value for name, value in values.items()))
