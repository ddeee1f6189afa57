"""Persistence of tuned strategies: the best strategy per key, and every recorded result.

Any SQLAlchemy URL works (``sqlite:///PATH`` by default, ``postgresql://USER@HOST/DB`` for a team).
Our tables carry the prefix ``autotune_``; Optuna keeps its studies and trials in its own tables of
the same database (``Storage.optuna_storage()``), so ``optuna-dashboard URL`` shows the tuning runs.

- ``autotune_best``: one row per ``StrategyKey`` (model id + revision, draft id, task, hardware):
  the strategy JSON with the highest ``score`` recorded for the key and its metrics.
- ``autotune_history``: every result ever recorded (append only).
- ``autotune_prompts``: the prompts a result was tuned on (its routing texts, in order; at most
  ``PROMPTS_PER_RECORD``, each clipped to ``PROMPT_CHARS``), by history row: what the server's task
  router is fitted on (``Storage.routes``).

Each ``record`` is one transaction (history row + prompt rows + best row, or nothing: a crash never
leaves a half-written strategy). A database created before ``autotune_prompts`` existed gains the
table when opened (its old results have no prompts). Concurrent writers end with the true best: on SQLite every write transaction
starts with ``BEGIN IMMEDIATE`` (writers queue on the WAL write lock behind a busy timeout); on
PostgreSQL the best row is offered with ``INSERT .. ON CONFLICT DO NOTHING`` and then a conditional
``UPDATE .. WHERE score < new``, whose row lock re-checks the condition against the latest version.
"""
from __future__ import annotations

import importlib.util
import os
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import (
    Column, DateTime, Float, Index, Integer, MetaData, String, Table, Text, UniqueConstraint, and_, create_engine,
    delete, event, insert, or_, select, update,
)
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, IntegrityError, NoSuchModuleError, OperationalError

from autotune.errors import StorageError
from autotune.store.records import (
    KEY_LIMITS, PROMPT_CHARS, PROMPTS_PER_RECORD, STUDY_NAME_LIMIT, HistoryEntry, ResultMetrics, StoredStrategy,
    StrategyKey, bounded_prompts,
)
from search_spaces.strategy import Strategy

__all__ = [
    "PROMPTS_PER_RECORD", "PROMPT_CHARS", "HistoryEntry", "ResultMetrics", "Storage", "StoredStrategy", "StrategyKey",
    "default_storage_url", "open_storage",
]

ENV_STORAGE = "AUTOTUNE_STORAGE"  # overrides the default SQLite file
SQLITE_TIMEOUT_S = 30.0  # how long a writer waits for another process's write lock
CONNECT_TIMEOUT_S = 10  # how long to wait for a database server before giving up
WRITE_ATTEMPTS = 8  # retries of a write transaction that failed on a lock or serialization conflict
_WRITE = "autotune_write"  # connection execution option: this transaction writes
_PG_DDL_LOCK = 7_301_771_402  # advisory lock id serialising CREATE TABLE on PostgreSQL

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


def _utcnow() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


def _row_key(row: Any) -> StrategyKey:
    return StrategyKey(**{name: getattr(row, name) for name in KEY_LIMITS})


def _stored(row: Any) -> StoredStrategy:
    return StoredStrategy(
        id=row.id, key=_row_key(row), strategy_json=row.strategy, score=row.score, measured_tps=row.measured_tps,
        predicted_tps=row.predicted_tps, acceptance=row.acceptance, study_name=row.study_name,
        history_id=row.history_id, updated_at=row.updated_at.replace(tzinfo=timezone.utc),
    )


def _entry(row: Any) -> HistoryEntry:
    return HistoryEntry(
        id=row.id, key=_row_key(row), recorded_at=row.recorded_at.replace(tzinfo=timezone.utc),
        strategy_json=row.strategy, score=row.score, measured_tps=row.measured_tps, predicted_tps=row.predicted_tps,
        acceptance=row.acceptance, speedup=row.speedup, tuning_share=row.tuning_share, study_name=row.study_name,
    )


def _key_match(table: Table, key: StrategyKey) -> Any:
    return and_(*(table.c[name] == value for name, value in key.as_row().items()))


def _scope(table: Table, model_id: str, model_revision: str, draft_id: str, hardware: str) -> Any:
    """Rows of one model / draft / hardware, any task."""
    values = dict(model_id=model_id, model_revision=model_revision, draft_id=draft_id, hardware=hardware)
    return and_(*(table.c[name] == value for name, value in values.items()))


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
        supersedes: int | None = None,
    ) -> int:
        """Append a history row with the ``prompts`` the strategy was tuned on (their routing texts,
        bounded as ``bounded_prompts`` says) and make ``strategy`` the key's best when its score
        beats the stored best (or none is stored), in one transaction. Returns the history row id.

        ``supersedes``: the history row of the best this result re-tunes (the traffic changed, so
        scores measured on the old traffic no longer compare): the best is replaced while it is
        still that row; once another result replaced it (a second replica re-tuning the same
        route), the higher score stays. Every result keeps its history row either way."""
        if not isinstance(strategy, Strategy):
            raise TypeError(f"strategy must be a Strategy, got {type(strategy).__name__}")
        text = strategy.to_json()
        texts = bounded_prompts(prompts)

        def work(conn: Connection) -> int:
            now = _utcnow()
            row = {**key.as_row(), **metrics.as_row()}
            history_id = conn.execute(
                insert(history_table).values(**row, recorded_at=now, strategy=text)
            ).inserted_primary_key[0]
            if texts:
                rows = [{"history_id": history_id, "position": i, "text": t} for i, t in enumerate(texts)]
                conn.execute(insert(prompts_table), rows)
            _offer_best(conn, key, text, metrics, history_id, now, supersedes)
            return int(history_id)

        return self._write(work)

    def delete(self, best_id: int) -> bool:
        """Forget the best strategy ``best_id`` (its history stays). False when no such row."""
        query = delete(best_table).where(best_table.c.id == best_id)
        return self._write(lambda conn: conn.execute(query).rowcount == 1)

    # ------------------------------------------------------------------ reads
    def best(self, key: StrategyKey) -> StoredStrategy | None:
        row = self._read(lambda conn: conn.execute(select(best_table).where(_key_match(best_table, key))).first())
        return None if row is None else _stored(row)

    def get(self, best_id: int) -> StoredStrategy | None:
        row = self._read(lambda conn: conn.execute(select(best_table).where(best_table.c.id == best_id)).first())
        return None if row is None else _stored(row)

    def list_best(self, **filters: str) -> list[StoredStrategy]:
        """All best rows (by id), optionally only those whose key columns equal ``filters``."""
        unknown = sorted(set(filters) - set(KEY_LIMITS))
        if unknown:
            raise TypeError(f"unknown key column(s) {unknown}; known: {list(KEY_LIMITS)}")
        query = select(best_table).where(*(best_table.c[k] == v for k, v in filters.items())).order_by(best_table.c.id)
        return [_stored(row) for row in self._read(lambda conn: conn.execute(query).all())]

    def history(self, key: StrategyKey) -> list[HistoryEntry]:
        """Every result recorded for ``key``, oldest first."""
        query = select(history_table).where(_key_match(history_table, key)).order_by(history_table.c.id)
        return [_entry(row) for row in self._read(lambda conn: conn.execute(query).all())]

    def prompts(self, history_id: int) -> list[str]:
        """The prompts recorded with history row ``history_id``, in order (empty when none were)."""
        query = select(prompts_table.c.text).where(prompts_table.c.history_id == history_id)
        return list(self._read(lambda conn: conn.execute(query.order_by(prompts_table.c.position)).scalars().all()))

    def routes(
        self, model_id: str, model_revision: str, draft_id: str, hardware: str
    ) -> list[tuple[StoredStrategy, list[str]]]:
        """Every best row of this model / draft / hardware (any task, by id), each with the prompts
        of the history row it came from: what a task router is fitted on. One transaction."""
        scope = _scope(best_table, model_id, model_revision, draft_id, hardware)

        def work(conn: Connection) -> list[tuple[StoredStrategy, list[str]]]:
            bests = [_stored(row) for row in conn.execute(select(best_table).where(scope).order_by(best_table.c.id))]
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
        scope = _scope(best_table, model_id, model_revision, draft_id, hardware)
        query = select(best_table.c.id, best_table.c.history_id).where(scope).order_by(best_table.c.id)
        return tuple((int(i), int(h)) for i, h in self._read(lambda conn: conn.execute(query).all()))

    def optuna_storage(self) -> Any:
        """An ``optuna.storages.RDBStorage`` on the same database (studies live beside our tables)."""
        import optuna

        for attempt in range(WRITE_ATTEMPTS):
            try:
                return optuna.storages.RDBStorage(url=self.url, engine_kwargs=_engine_kwargs(self._engine.url))
            except DBAPIError as exc:
                # two processes opening a new database at once race to create Optuna's tables; the
                # loser sees "already exists", a duplicate type or a lock, and finds them on the next try
                if attempt + 1 == WRITE_ATTEMPTS:
                    raise StorageError(f"storage {self.display_url}: cannot open Optuna's tables: {_first_line(exc)}") from exc
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
                        conn.execution_options(**{_WRITE: True})
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
            if retryable and _transient(exc):
                raise _Retry() from exc
            raise StorageError(f"storage {self.display_url} failed: {_first_line(exc)}") from exc


class _Retry(Exception):
    """A write transaction hit a transient conflict and is tried again."""


def _offer_best(
    conn: Connection, key: StrategyKey, text: str, metrics: ResultMetrics, history_id: int, now: datetime,
    supersedes: int | None = None,
) -> None:
    """Insert the key's best row, or replace it when ``metrics.score`` is strictly higher (or
    while it is still the row ``supersedes`` names)."""
    measured = metrics.as_row()
    values = {name: measured[name] for name in ("score", "measured_tps", "predicted_tps", "acceptance", "study_name")}
    values.update(strategy=text, history_id=history_id, updated_at=now)
    dialect = conn.dialect.name
    if dialect in ("sqlite", "postgresql"):
        dialect_insert = importlib.import_module(f"sqlalchemy.dialects.{dialect}").insert
        stmt = dialect_insert(best_table).values(**key.as_row(), **values)
        if conn.execute(stmt.on_conflict_do_nothing(index_elements=list(KEY_LIMITS))).rowcount == 1:
            return
    else:  # generic: lock the row; a concurrent first insert fails the unique key and is retried
        found = conn.execute(select(best_table.c.id).where(_key_match(best_table, key)).with_for_update()).first()
        if found is None:
            conn.execute(insert(best_table).values(**key.as_row(), **values))
            return
    better = best_table.c.score < metrics.score
    if supersedes is not None:
        better = or_(better, best_table.c.history_id == supersedes)
    conn.execute(update(best_table).where(_key_match(best_table, key), better).values(**values))


def _transient(exc: DBAPIError) -> bool:
    """Lock timeouts (SQLite), serialization failures and deadlocks (PostgreSQL), duplicate first inserts."""
    if isinstance(exc, IntegrityError):
        return True
    code = getattr(exc.orig, "sqlstate", None) or getattr(exc.orig, "pgcode", None)
    if code in ("40001", "40P01"):
        return True
    message = str(exc.orig).lower()
    return isinstance(exc, OperationalError) and ("database is locked" in message or "database is busy" in message)


def _first_line(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None) or exc
    lines = [line.strip() for line in str(orig).splitlines() if line.strip()]
    return lines[0] if lines else type(orig).__name__


# ---------------------------------------------------------------------- opening
def default_storage_url() -> str:
    """``$AUTOTUNE_STORAGE``, else a SQLite file in the user data directory (created)."""
    env = os.environ.get(ENV_STORAGE)
    if env:
        return env
    from platformdirs import user_data_dir

    folder = Path(user_data_dir("autotune"))
    folder.mkdir(parents=True, exist_ok=True)
    return URL.create("sqlite", database=str(folder / "autotune.db")).render_as_string()


def open_storage(url: str | None = None) -> Storage:
    """Connect to ``url`` (default: ``default_storage_url()``) and create our tables if missing.

    Raises ``StorageError`` for a malformed URL, an unknown or missing driver, or a database that
    cannot be reached or opened.
    """
    text = default_storage_url() if url is None else url
    parsed = _parse_url(text)
    shown = make_url(text).render_as_string(hide_password=True)  # as the user wrote it
    try:
        engine = create_engine(parsed, **_engine_kwargs(parsed))
    except NoSuchModuleError:
        raise StorageError(
            f"unknown database driver '{parsed.drivername}' in storage URL {shown}; "
            "use sqlite:///PATH or postgresql://USER:PASSWORD@HOST/DB"
        ) from None
    except ImportError as exc:
        raise StorageError(
            f"the Python driver for '{parsed.drivername}' is not installed ({exc.name or exc}); install it, "
            "e.g. pip install 'psycopg[binary]' for postgresql"
        ) from None
    if engine.dialect.name == "sqlite":
        _configure_sqlite(engine)
    storage = Storage(engine)
    try:
        storage.create_tables()
    except StorageError as exc:
        engine.dispose()
        cause = _first_line(exc.__cause__) if exc.__cause__ else str(exc)
        hint = (
            "check that the file's directory exists and is writable" if engine.dialect.name == "sqlite"
            else "check that the server is running and the URL is right"
        )
        raise StorageError(
            f"cannot open storage {shown}: {cause}; {hint}, "
            f"or leave out --storage (and ${ENV_STORAGE}) to use the local SQLite file"
        ) from None
    return storage


def _parse_url(text: str) -> URL:
    example = "e.g. sqlite:////abs/path/autotune.db or postgresql://user:password@host:5432/db"
    try:
        parsed = make_url(text)
    except (ArgumentError, ValueError) as exc:
        raise StorageError(f"storage URL {text!r} is malformed ({exc}); use a SQLAlchemy URL, {example}") from None
    if parsed.drivername == "postgresql" and importlib.util.find_spec("psycopg2") is None:
        if importlib.util.find_spec("psycopg") is not None:  # SQLAlchemy 2.0 defaults to psycopg2
            parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


def _engine_kwargs(url: URL) -> dict[str, Any]:
    if url.get_backend_name() == "sqlite":
        return {"connect_args": {"timeout": SQLITE_TIMEOUT_S}}
    if url.get_backend_name() == "postgresql":
        return {"pool_pre_ping": True, "connect_args": {"connect_timeout": CONNECT_TIMEOUT_S}}
    return {"pool_pre_ping": True}


def _configure_sqlite(engine: Engine) -> None:
    """WAL (readers never block the writer), a busy timeout, and SQLAlchemy-controlled BEGIN:
    ``BEGIN IMMEDIATE`` for writes so two writers queue instead of failing mid-transaction."""

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # we emit BEGIN ourselves
        cursor = dbapi_conn.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {int(SQLITE_TIMEOUT_S * 1000)}")
        cursor.execute("PRAGMA journal_mode = WAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get(_WRITE) else "BEGIN")
