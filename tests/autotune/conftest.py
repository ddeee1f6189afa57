"""Fixtures shared by the autotune tests: a store of tuned strategies, a guard against model loads
and a throwaway PostgreSQL server (the helpers they use are in ``tests/helpers.py``)."""
from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

from autotune.store.storage import ResultMetrics, open_storage
from tests.helpers import STORED, stored_key


# ---------------------------------------------------------------------- a store of tuned strategies
@pytest.fixture
def url(tmp_path) -> str:
    """A SQLite store holding ``tests.helpers.STORED`` (ids as ``tests.helpers.IDS``)."""
    url = f"sqlite:///{tmp_path / 'store.db'}"
    with open_storage(url) as storage:
        for n, (draft, task, strategy) in enumerate(STORED.values()):
            storage.record(stored_key(draft, task), strategy, ResultMetrics.from_throughput(10.0 + n, acceptance=0.5))
    return url


@pytest.fixture
def no_model_loads(monkeypatch):
    from runtime.pipeline import ModelPool

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded; the error should come before")

    monkeypatch.setattr(ModelPool, "get", refuse)


# ---------------------------------------------------------------------- a PostgreSQL server
def _pg_bindir() -> Path | None:
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).parent
    version = lambda d: [int(x) for x in Path(d).parent.name.split(".") if x.isdigit()]  # noqa: E731
    dirs = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=version)
    return Path(dirs[-1]) if dirs and (Path(dirs[-1]) / "pg_ctl").exists() else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_server_user(base: Path) -> list[str]:
    """PostgreSQL refuses to run as root: run it as 'postgres' (or 'nobody') owning ``base``."""
    if os.geteuid() != 0:
        return []
    for user in ("postgres", "nobody"):
        try:
            entry = pwd.getpwnam(user)
        except KeyError:
            continue
        for path in [base, *base.rglob("*")]:
            os.chown(path, entry.pw_uid, entry.pw_gid)
        return ["runuser", "-u", user, "--"]
    pytest.fail("running as root and neither a 'postgres' nor a 'nobody' user exists to run PostgreSQL")


@pytest.fixture(scope="session")
def postgres_server():
    """Base URL of a throwaway PostgreSQL server on loopback (trust auth, user 'autotune')."""
    if os.environ.get("AUTOTUNE_TEST_POSTGRES") != "1":
        pytest.skip("PostgreSQL tests are off: set AUTOTUNE_TEST_POSTGRES=1 (needs initdb/pg_ctl and psycopg)")
    pytest.importorskip("psycopg", reason="PostgreSQL tests need psycopg: pip install 'psycopg[binary]'")
    bindir = _pg_bindir()
    if bindir is None:
        pytest.fail("AUTOTUNE_TEST_POSTGRES=1 but no PostgreSQL server binaries found; apt-get install postgresql")
    base = Path(tempfile.mkdtemp(prefix="autotune-pg-"))
    runas = _as_server_user(base)
    data, port = base / "data", _free_port()
    subprocess.run(
        [*runas, str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "autotune", "--no-sync", "-E", "UTF8"],
        check=True, capture_output=True, cwd=base,
    )
    ctl = [*runas, str(bindir / "pg_ctl"), "-D", str(data), "-l", str(base / "log")]
    subprocess.run([*ctl, "-o", f"-k {base} -p {port} -h 127.0.0.1 -F", "-w", "-t", "60", "start"],
                   check=True, capture_output=True, cwd=base)
    try:
        yield f"postgresql+psycopg://autotune@127.0.0.1:{port}"
    finally:
        subprocess.run([*ctl, "-m", "immediate", "stop"], capture_output=True, cwd=base)
        shutil.rmtree(base, ignore_errors=True)
