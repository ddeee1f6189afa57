"""Persistence of tuned strategies: the best strategy per key, and every recorded result.

Any SQLAlchemy URL works (``sqlite:///PATH`` by default, ``postgresql://USER@HOST/DB`` for a team).
Our tables carry the prefix ``autotune_``; Optuna keeps its studies and trials in its own tables of
the same database (``Storage.optuna_storage()``), so ``optuna-dashboard URL`` shows the tuning runs.

The tables (``autotune.store.schema``): ``autotune_best`` (one best row per ``StrategyKey``),
``autotune_history`` (every result, append only), ``autotune_prompts`` (the routing texts a
result was tuned on: what the server's task router is fitted on, ``Storage.routes``) and
``autotune_costs`` (the tuner's cost-model timings, ``Storage.costs``). Opening a
database (URLs, drivers, SQLite's set-up) is ``autotune.store.engine``.

Each ``record`` is one transaction (history row + prompt rows + best row, or nothing: a crash never
leaves a half-written strategy). A database created before ``autotune_prompts`` existed gains the
table when opened (its old results have no prompts). Concurrent writers end with the true best: on SQLite every write transaction
starts with ``BEGIN IMMEDIATE`` (writers queue on the WAL write lock behind a busy timeout); on
PostgreSQL the best row is offered with ``INSERT .. ON CONFLICT DO NOTHING`` and then a conditional
``UPDATE .. WHERE score < new``, whose row lock re-checks the condition against the latest version.
"""
from __future__ import annotations

import importlib
import json
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import and_, delete, insert, or_, select, update
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError

from autotune.errors import StorageError
from autotune.store.engine import (
    ENV_STORAGE, WRITE, default_storage_url, engine_kwargs, first_line, make_engine, transient,
)
from autotune.store.records import (
    COST_SHAPE_LIMIT, KEY_LIMITS, PROMPT_CHARS, PROMPTS_PER_RECORD, HistoryEntry, ResultMetrics, StoredStrategy, StrategyKey,
    bounded_prompts,
)
from autotune.store.schema import (
    best_table, costs_table, entry_from_row, history_table, key_match, metadata, prompts_table, scope, stored_from_row, utcnow,
)
from search_spaces.strategy import Strategy

__all__ = [
    "PROMPTS_PER_RECORD", "PROMPT_CHARS", "HistoryEntry", "KeyTaken", "ResultMetrics", "Storage", "StoredStrategy", "StrategyKey",
    "default_storage_url", "open_storage",
]

WRITE_ATTEMPTS = 8  # retries of a write transaction that failed on a lock or serialization conflict
_PG_DDL_LOCK = 7_301_771_402  # advisory lock id serialising CREATE TABLE on PostgreSQL

T = TypeVar("T")


class Storage:
    """The strategy store on one database. Open with ``open_storage``; close (or use ``with``)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    @property
    def url(self) -> str:
        """The database URL, password included (what Optuna and other tools need)."""
        return self._engine.url.render_as_string(hide_password=False)

    @property
    def display_url(self) -> str:
        return self._engine.url.render_as_string(hide_password=True)

    def close(self) -> None:
        self._engine.dispose()

    def __enter__(self) -> "Storage":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ writes
    def record(
        self, key: StrategyKey, strategy: Strategy, metrics: ResultMetrics, prompts: Sequence[str] = (),
        supersedes: int | None = None, offer: bool = True, new_key: bool = False,
    ) -> int:
        """Append a history row with the ``prompts`` the strategy was tuned on (their routing texts,
        bounded as ``bounded_prompts`` says) and make ``strategy`` the key's best when its score
        beats the stored best (or none is stored), in one transaction. Returns the history row id.

        ``supersedes``: the history row of the best this result re-tunes (the traffic changed, so
        scores measured on the old traffic no longer compare): the best is replaced while it is
        still that row; once another result replaced it (a second replica re-tuning the same
        route), the higher score stays. Every result keeps its history row either way.

        ``offer=False`` appends the history row only (a result that must not replace the best).
        ``new_key=True`` claims a key no one holds: when the key has a best row already (another
        replica created it first), nothing is written and ``KeyTaken`` is raised."""
        if not isinstance(strategy, Strategy):
            raise TypeError(f"strategy must be a Strategy, got {type(strategy).__name__}")
        text = strategy.to_json()
        texts = bounded_prompts(prompts)

        def work(conn: Connection) -> int:
            now = utcnow()
            row = {**key.as_row(), **metrics.as_row()}
            history_id = conn.execute(
                insert(history_table).values(**row, recorded_at=now, strategy=text)
            ).inserted_primary_key[0]
            if texts:
                rows = [{"history_id": history_id, "position": i, "text": t} for i, t in enumerate(texts)]
                conn.execute(insert(prompts_table), rows)
            if new_key and conn.execute(select(best_table.c.id).where(key_match(best_table, key))).first():
                raise KeyTaken(key.task)  # rolls the transaction back: no history row either
            if offer:
                _offer_best(conn, key, text, metrics, history_id, now, supersedes, new_key)
            return int(history_id)

        return self._write(work)

    def keep_costs(self, key: StrategyKey, shape: str, timings: dict[str, Any]) -> None:
        """Keep the cost model's ``timings`` for ``key``'s model, draft and hardware (any task) and
        ``shape``, replacing what was kept (one transaction)."""
        text = json.dumps(timings)
        if len(shape) > COST_SHAPE_LIMIT:
            raise StorageError(f"cost shape {shape[:40]!r}... is longer than {COST_SHAPE_LIMIT} characters")
        where = _costs_match(key, shape)

        def work(conn: Connection) -> None:
            conn.execute(delete(costs_table).where(where))
            conn.execute(insert(costs_table).values(
                model_id=key.model_id, model_revision=key.model_revision, draft_id=key.draft_id,
                hardware=key.hardware, shape=shape, timings=text, updated_at=utcnow()))

        self._write(work)

    def costs(self, key: StrategyKey, shape: str) -> dict[str, Any] | None:
        """The timings kept by ``keep_costs`` for ``key``'s model, draft and hardware and ``shape``,
        or None (none kept, or unreadable: they are timed again)."""
        query = select(costs_table.c.timings).where(_costs_match(key, shape))
        text = self._read(lambda conn: conn.execute(query).scalar())
        try:
            kept = json.loads(text) if text else None
        except ValueError:
            return None
        return kept if isinstance(kept, dict) else None

    def delete(self, best_id: int) -> bool:
        """Forget the best strategy ``best_id`` (its history stays). False when no such row."""
        query = delete(best_table).where(best_table.c.id == best_id)
        return self._write(lambda conn: conn.execute(query).rowcount == 1)

    # ------------------------------------------------------------------ reads
    def best(self, key: StrategyKey) -> StoredStrategy | None:
        row = self._read(lambda conn: conn.execute(select(best_table).where(key_match(best_table, key))).first())
        return None if row is None else stored_from_row(row)

    def get(self, best_id: int) -> StoredStrategy | None:
        row = self._read(lambda conn: conn.execute(select(best_table).where(best_table.c.id == best_id)).first())
        return None if row is None else stored_from_row(row)

    def list_best(self, **filters: str) -> list[StoredStrategy]:
        """All best rows (by id), optionally only those whose key columns equal ``filters``."""
        unknown = sorted(set(filters) - set(KEY_LIMITS))
        if unknown:
            raise TypeError(f"unknown key column(s) {unknown}; known: {list(KEY_LIMITS)}")
        query = select(best_table).where(*(best_table.c[k] == v for k, v in filters.items())).order_by(best_table.c.id)
        return [stored_from_row(row) for row in self._read(lambda conn: conn.execute(query).all())]

    def history(self, key: StrategyKey) -> list[HistoryEntry]:
        """Every result recorded for ``key``, oldest first."""
        query = select(history_table).where(key_match(history_table, key)).order_by(history_table.c.id)
        return [entry_from_row(row) for row in self._read(lambda conn: conn.execute(query).all())]

    def prompts(self, history_id: int) -> list[str]:
        """The prompts recorded with history row ``history_id``, in order (empty when none were)."""
        query = select(prompts_table.c.text).where(prompts_table.c.history_id == history_id)
        return list(self._read(lambda conn: conn.execute(query.order_by(prompts_table.c.position)).scalars().all()))

    def routes(
        self, model_id: str, model_revision: str, draft_id: str, hardware: str
    ) -> list[tuple[StoredStrategy, list[str]]]:
        """Every best row of this model / draft / hardware (any task, by id), each with the prompts
        of the history row it came from: what a task router is fitted on. One transaction."""
        of_scope = scope(best_table, model_id, model_revision, draft_id, hardware)

        def work(conn: Connection) -> list[tuple[StoredStrategy, list[str]]]:
            rows = conn.execute(select(best_table).where(of_scope).order_by(best_table.c.id))
            bests = [stored_from_row(row) for row in rows]
            texts: dict[int, list[str]] = {b.history_id: [] for b in bests}
            if texts:
                query = select(prompts_table.c.history_id, prompts_table.c.text).where(
                    prompts_table.c.history_id.in_(list(texts))
                ).order_by(prompts_table.c.history_id, prompts_table.c.position)
                for history_id, text in conn.execute(query):
                    texts[history_id].append(text)
            return [(b, list(texts[b.history_id])) for b in bests]

        return self._read(work)

    def version(self, model_id: str, model_revision: str, draft_id: str, hardware: str) -> tuple[tuple[int, int], ...]:
        """A cheap fingerprint of this model / draft / hardware's best rows, to compare for
        equality: it changes whenever a best row is added, replaced (a new history row) or deleted."""
        of_scope = scope(best_table, model_id, model_revision, draft_id, hardware)
        query = select(best_table.c.id, best_table.c.history_id).where(of_scope).order_by(best_table.c.id)
        return tuple((int(i), int(h)) for i, h in self._read(lambda conn: conn.execute(query).all()))

    def optuna_storage(self) -> Any:
        """An ``optuna.storages.RDBStorage`` on the same database (studies live beside our tables)."""
        import optuna

        for attempt in range(WRITE_ATTEMPTS):
            try:
                return optuna.storages.RDBStorage(url=self.url, engine_kwargs=engine_kwargs(self._engine.url))
            except DBAPIError as exc:
                # two processes opening a new database at once race to create Optuna's tables; the
                # loser sees "already exists", a duplicate type or a lock, and finds them on the next try
                if attempt + 1 == WRITE_ATTEMPTS:
                    raise StorageError(f"storage {self.display_url}: cannot open Optuna's tables: {first_line(exc)}") from exc
                time.sleep(min(2.0, 0.05 * 2**attempt) * random.uniform(0.5, 1.5))
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ transactions
    def _read(self, work: Callable[[Connection], T]) -> T:
        with self._db_errors():
            with self._engine.connect() as conn, conn.begin():
                return work(conn)

    def _write(self, work: Callable[[Connection], T]) -> T:
        """Run ``work`` in one write transaction, retrying lock and serialization conflicts."""
        for attempt in range(WRITE_ATTEMPTS):
            try:
                with self._db_errors(retryable=attempt + 1 < WRITE_ATTEMPTS):
                    with self._engine.connect() as conn:
                        conn.execution_options(**{WRITE: True})
                        with conn.begin():
                            return work(conn)
            except _Retry:
                time.sleep(min(2.0, 0.02 * 2**attempt) * random.uniform(0.5, 1.5))
        raise AssertionError("unreachable")

    def create_tables(self) -> None:
        """Create our tables when missing (safe when several processes open a new database at once)."""

        def work(conn: Connection) -> None:
            if conn.dialect.name == "postgresql":
                conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_PG_DDL_LOCK})")
            metadata.create_all(conn)

        self._write(work)

    @contextmanager
    def _db_errors(self, retryable: bool = False) -> Iterator[None]:
        try:
            yield
        except DBAPIError as exc:
            if retryable and transient(exc):
                raise _Retry() from exc
            raise StorageError(f"storage {self.display_url} failed: {first_line(exc)}") from exc


def _costs_match(key: StrategyKey, shape: str) -> Any:
    return and_(costs_table.c.model_id == key.model_id, costs_table.c.model_revision == key.model_revision,
                costs_table.c.draft_id == key.draft_id, costs_table.c.hardware == key.hardware,
                costs_table.c.shape == shape)


class KeyTaken(Exception):
    """``record(..., new_key=True)`` found the key held already (its task name is the message)."""


class _Retry(Exception):
    """A write transaction hit a transient conflict and is tried again."""


def _offer_best(
    conn: Connection, key: StrategyKey, text: str, metrics: ResultMetrics, history_id: int, now: datetime,
    supersedes: int | None = None, new_key: bool = False,
) -> None:
    """Insert the key's best row, or replace it when ``metrics.score`` is strictly higher (or
    while it is still the row ``supersedes`` names). ``new_key``: a concurrent first insert of the
    key (another replica's) raises ``KeyTaken`` instead of being compared with."""
    measured = metrics.as_row()
    values = {name: measured[name] for name in ("score", "measured_tps", "predicted_tps", "acceptance", "study_name")}
    values.update(strategy=text, history_id=history_id, updated_at=now)
    dialect = conn.dialect.name
    if dialect in ("sqlite", "postgresql"):
        dialect_insert = importlib.import_module(f"sqlalchemy.dialects.{dialect}").insert
        stmt = dialect_insert(best_table).values(**key.as_row(), **values)
        if conn.execute(stmt.on_conflict_do_nothing(index_elements=list(KEY_LIMITS))).rowcount == 1:
            return
        if new_key:
            raise KeyTaken(key.task)
    else:  # generic: lock the row; a concurrent first insert fails the unique key and is retried
        found = conn.execute(select(best_table.c.id).where(key_match(best_table, key)).with_for_update()).first()
        if found is None:
            conn.execute(insert(best_table).values(**key.as_row(), **values))
            return
        if new_key:
            raise KeyTaken(key.task)
    better = best_table.c.score < metrics.score
    if supersedes is not None:
        better = or_(better, best_table.c.history_id == supersedes)
    conn.execute(update(best_table).where(key_match(best_table, key), better).values(**values))


# ---------------------------------------------------------------------- opening
def open_storage(url: str | None = None) -> Storage:
    """Connect to ``url`` (default: ``default_storage_url()``) and create our tables if missing.

    Raises ``StorageError`` for a malformed URL, an unknown or missing driver, or a database that
    cannot be reached or opened.
    """
    engine, shown = make_engine(default_storage_url() if url is None else url)
    storage = Storage(engine)
    try:
        storage.create_tables()
    except StorageError as exc:
        engine.dispose()
        cause = first_line(exc.__cause__) if exc.__cause__ else str(exc)
        hint = (
            "check that the file's directory exists and is writable" if engine.dialect.name == "sqlite"
            else "check that the server is running and the URL is right"
        )
        raise StorageError(
            f"cannot open storage {shown}: {cause}; {hint}, "
            f"or leave out --storage (and ${ENV_STORAGE}) to use the local SQLite file"
        ) from None
    return storage
