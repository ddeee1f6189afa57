"""Opening a database: the default URL, URL parsing, engine options per backend, SQLite's set-up,
and which database errors are transient (retried) or shown (their first line)."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, event
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, IntegrityError, NoSuchModuleError, OperationalError

from autotune.errors import StorageError

ENV_STORAGE = "AUTOTUNE_STORAGE"  # overrides the default SQLite file
SQLITE_TIMEOUT_S = 30.0  # how long a writer waits for another process's write lock
CONNECT_TIMEOUT_S = 10  # how long to wait for a database server before giving up
WRITE = "autotune_write"  # connection execution option: this transaction writes


def default_storage_url() -> str:
    """``$AUTOTUNE_STORAGE``, else a SQLite file in the user data directory (created)."""
    env = os.environ.get(ENV_STORAGE)
    if env:
        return env
    from platformdirs import user_data_dir

    folder = Path(user_data_dir("autotune"))
    folder.mkdir(parents=True, exist_ok=True)
    return URL.create("sqlite", database=str(folder / "autotune.db")).render_as_string()


def make_engine(text: str) -> tuple[Engine, str]:
    """An engine for the URL ``text`` and the URL as shown to users (password hidden). Raises
    ``StorageError`` for a malformed URL or an unknown or missing driver."""
    parsed = parse_url(text)
    shown = make_url(text).render_as_string(hide_password=True)  # as the user wrote it
    try:
        engine = create_engine(parsed, **engine_kwargs(parsed))
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
        configure_sqlite(engine)
    return engine, shown


def parse_url(text: str) -> URL:
    example = "e.g. sqlite:////abs/path/autotune.db or postgresql://user:password@host:5432/db"
    try:
        parsed = make_url(text)
    except (ArgumentError, ValueError) as exc:
        raise StorageError(f"storage URL {text!r} is malformed ({exc}); use a SQLAlchemy URL, {example}") from None
    if parsed.drivername == "postgresql" and importlib.util.find_spec("psycopg2") is None:
        if importlib.util.find_spec("psycopg") is not None:  # SQLAlchemy 2.0 defaults to psycopg2
            parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


def engine_kwargs(url: URL) -> dict[str, Any]:
    if url.get_backend_name() == "sqlite":
        return {"connect_args": {"timeout": SQLITE_TIMEOUT_S}}
    if url.get_backend_name() == "postgresql":
        return {"pool_pre_ping": True, "connect_args": {"connect_timeout": CONNECT_TIMEOUT_S}}
    return {"pool_pre_ping": True}


def configure_sqlite(engine: Engine) -> None:
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
        conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get(WRITE) else "BEGIN")


def transient(exc: DBAPIError) -> bool:
    """Lock timeouts (SQLite), serialization failures and deadlocks (PostgreSQL), duplicate first inserts."""
    if isinstance(exc, IntegrityError):
        return True
    code = getattr(exc.orig, "sqlstate", None) or getattr(exc.orig, "pgcode", None)
    if code in ("40001", "40P01"):
        return True
    message = str(exc.orig).lower()
    return isinstance(exc, OperationalError) and ("database is locked" in message or "database is busy" in message)


def first_line(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None) or exc
    lines = [line.strip() for line in str(orig).splitlines() if line.strip()]
    return lines[0] if lines else type(orig).__name__
