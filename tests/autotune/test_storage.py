"""The strategy store: round trips, best-only-if-better, atomic writes, concurrent writers, crashes,
and the prompts stored with each result (what the server's task router is fitted on).

Every test taking ``store_url`` runs on SQLite and, with ``AUTOTUNE_TEST_POSTGRES=1``, on a throwaway
PostgreSQL server started from the system's server binaries (skipped with the reason otherwise).
"""
from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from autotune.errors import StorageError
from autotune.store.storage import (
    PROMPT_CHARS, PROMPTS_PER_RECORD, ResultMetrics, Storage, StrategyKey, default_storage_url, open_storage,
)
from search_spaces.errors import StrategyError
from search_spaces.strategy import PLAIN, Strategy

REPO = Path(__file__).resolve().parents[2]
KEY = StrategyKey("smollm2-135m@gguf:b179c9523d0e", "b179c9523d0e", "", "gsm8k", "test-cpu x2")
REQUIRED = ("model_id", "model_revision", "draft_id", "task", "hardware", "recorded_at", "strategy", "score")


# ---------------------------------------------------------------------- servers (postgres_server: conftest.py)
_db_numbers = itertools.count()


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request, tmp_path) -> str:
    """A fresh, empty database: a SQLite file, or a new database on the PostgreSQL server."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'store.db'}"
    import psycopg

    base = request.getfixturevalue("postgres_server")
    name = f"autotune_t{os.getpid()}_{next(_db_numbers)}"
    with psycopg.connect(base.replace("postgresql+psycopg", "postgresql") + "/postgres", autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return f"{base}/{name}"


@pytest.fixture
def store(store_url):
    with open_storage(store_url) as storage:
        yield storage


# ---------------------------------------------------------------------- round trips
def test_record_best_list_get_delete_history(store: Storage):
    lookup = Strategy(drafter="prompt-lookup", draft_length=5)
    hid = store.record(KEY, lookup, ResultMetrics.from_throughput(
        21.5, predicted_tps=20.0, acceptance=0.4, speedup=1.2, tuning_share=0.05, study_name="s1"))
    best = store.best(KEY)
    assert best is not None and best.strategy == lookup and best.history_id == hid
    assert (best.score, best.measured_tps, best.predicted_tps, best.acceptance, best.study_name) == (
        21.5, 21.5, 20.0, 0.4, "s1")
    assert best.key == KEY and best.updated_at.tzinfo is not None
    assert store.get(best.id) == best
    assert store.list_best() == [best]
    assert store.list_best(task="gsm8k", hardware=KEY.hardware) == [best]
    assert store.list_best(task="humaneval") == []
    [entry] = store.history(KEY)
    assert (entry.id, entry.strategy, entry.speedup, entry.tuning_share) == (hid, lookup, 1.2, 0.05)

    assert store.delete(best.id) is True
    assert store.get(best.id) is None and store.best(KEY) is None and store.list_best() == []
    assert store.delete(best.id) is False
    assert len(store.history(KEY)) == 1  # history is kept
    store.record(KEY, PLAIN, ResultMetrics(score=1.0))  # after a delete, any result is the best again
    assert store.best(KEY).strategy == PLAIN


def test_best_replaced_only_by_a_strictly_better_score(store: Storage):
    first = store.record(KEY, Strategy(draft_length=4), ResultMetrics(score=5.0))
    store.record(KEY, Strategy(draft_length=5), ResultMetrics(score=3.0))
    store.record(KEY, Strategy(draft_length=6), ResultMetrics(score=5.0))
    assert store.best(KEY).history_id == first and store.best(KEY).strategy.draft_length == 4
    better = store.record(KEY, Strategy(draft_length=7), ResultMetrics(score=7.5, acceptance=0.9))
    best = store.best(KEY)
    assert (best.history_id, best.score, best.acceptance, best.strategy.draft_length) == (better, 7.5, 0.9, 7)
    assert [e.score for e in store.history(KEY)] == [5.0, 3.0, 5.0, 7.5]
    assert len(store.list_best()) == 1


def test_a_retune_supersedes_the_best_it_replaces(store: Storage):
    """A route re-tuned on changed traffic replaces the best it re-tuned even with a lower score
    (scores measured on other traffic do not compare); a second re-tune of that same row (another
    replica) then only wins with a better score; every result keeps its history row."""
    old = store.record(KEY, Strategy(draft_length=8), ResultMetrics(score=20.0, acceptance=0.9))
    first = store.record(KEY, Strategy(draft_length=4), ResultMetrics(score=6.0, acceptance=0.5), supersedes=old)
    best = store.best(KEY)
    assert (best.history_id, best.score, best.strategy.draft_length) == (first, 6.0, 4)
    store.record(KEY, PLAIN, ResultMetrics(score=5.0), supersedes=old)  # the same row, re-tuned elsewhere: worse
    assert store.best(KEY).history_id == first
    better = store.record(KEY, Strategy(draft_length=3), ResultMetrics(score=7.0), supersedes=old)
    assert store.best(KEY).history_id == better
    assert [e.score for e in store.history(KEY)] == [20.0, 6.0, 5.0, 7.0]
    assert len(store.list_best()) == 1


def test_two_processes_retune_one_route_concurrently(store_url, tmp_path):
    """Two replicas re-tune the same stored row at once: both history rows stay, the better wins."""
    with open_storage(store_url) as storage:
        old = storage.record(KEY, Strategy(draft_length=8), ResultMetrics(score=50.0))
    go = tmp_path / "go"
    code = (
        "import json, os, sys, time\n"
        "from autotune.store.storage import ResultMetrics, StrategyKey, open_storage\n"
        "from search_spaces.strategy import Strategy\n"
        "url, score, go, old = sys.argv[1], float(sys.argv[2]), sys.argv[3], int(sys.argv[4])\n"
        "key = StrategyKey(*json.loads(sys.argv[5]))\n"
        "storage = open_storage(url)\n"
        "open(go + '.ready' + sys.argv[2], 'w').close()\n"
        "while not os.path.exists(go):\n    time.sleep(0.002)\n"
        "print(storage.record(key, Strategy(draft_length=int(score)), ResultMetrics(score=score), supersedes=old))\n"
    )
    key = json.dumps([KEY.model_id, KEY.model_revision, KEY.draft_id, KEY.task, KEY.hardware])
    procs = [subprocess.Popen([sys.executable, "-c", code, store_url, str(s), str(go), str(old), key], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for s in (3.0, 4.0)]
    deadline = time.monotonic() + 120
    while not all(Path(f"{go}.ready{s}").exists() for s in (3.0, 4.0)):
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline
        time.sleep(0.01)
    go.touch()
    ids = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        ids.append(int(out))
    with open_storage(store_url) as storage:
        history, best = storage.history(KEY), storage.best(KEY)
    assert [e.score for e in history][0] == 50.0 and sorted(e.score for e in history[1:]) == [3.0, 4.0]
    assert best.score == 4.0 and best.history_id == ids[1]


def test_keys_are_independent(store: Storage):
    other_draft = StrategyKey(KEY.model_id, KEY.model_revision, "smollm2-135m", KEY.task, KEY.hardware)
    other_hw = StrategyKey(KEY.model_id, KEY.model_revision, "", KEY.task, "other-cpu")
    store.record(KEY, PLAIN, ResultMetrics(score=1.0))
    store.record(other_draft, Strategy(), ResultMetrics(score=9.0))
    store.record(other_hw, Strategy(drafter="prompt-lookup"), ResultMetrics(score=4.0))
    assert store.best(KEY).strategy == PLAIN
    assert store.best(other_draft).score == 9.0 and store.best(other_hw).score == 4.0
    assert len(store.list_best()) == 3 and len(store.list_best(draft_id="")) == 2


def test_failure_inside_the_transaction_leaves_nothing(store: Storage, monkeypatch):
    import autotune.store.storage as storage_module

    store.record(KEY, PLAIN, ResultMetrics(score=2.0))

    def boom(*args, **kwargs):
        raise RuntimeError("crash between the history row and the best row")

    monkeypatch.setattr(storage_module, "_offer_best", boom)
    with pytest.raises(RuntimeError, match="crash between"):
        store.record(KEY, Strategy(), ResultMetrics(score=99.0))
    with pytest.raises(RuntimeError):
        store.record(StrategyKey("m", "r", "", "t", "hw"), Strategy(), ResultMetrics(score=1.0))
    monkeypatch.undo()
    assert [e.score for e in store.history(KEY)] == [2.0]
    assert store.best(KEY).strategy == PLAIN
    assert store.list_best() == [store.best(KEY)]


# ---------------------------------------------------------------------- prompts and routes
def _prompt_rows(url: str) -> int:
    engine = create_engine(url)
    with engine.connect() as conn:
        count = conn.execute(text("SELECT count(*) FROM autotune_prompts")).scalar()
    engine.dispose()
    return count


def test_prompts_are_recorded_with_the_result(store: Storage):
    texts = ["def add(a, b):", "Question: 2 + 3?\nAnswer:", "Write a haiku about the sea."]
    hid = store.record(KEY, PLAIN, ResultMetrics(score=1.0), prompts=texts)
    assert store.prompts(hid) == texts
    assert store.prompts(store.record(KEY, PLAIN, ResultMetrics(score=0.5))) == []  # none given: none stored
    assert store.prompts(hid + 1000) == []
    [(best, prompts)] = store.routes(KEY.model_id, KEY.model_revision, KEY.draft_id, KEY.hardware)
    assert best == store.best(KEY) and prompts == texts


def test_stored_prompts_are_bounded(store: Storage):
    long = "HEAD " + "x" * (3 * PROMPT_CHARS) + " TAIL\x00"
    hid = store.record(KEY, PLAIN, ResultMetrics(score=1.0), prompts=[long] + [f"p{i}" for i in range(100)])
    stored = store.prompts(hid)
    assert len(stored) == PROMPTS_PER_RECORD and stored[1:3] == ["p0", "p1"]
    assert len(stored[0]) == PROMPT_CHARS and stored[0].startswith("HEAD x") and stored[0].endswith("x TAIL")
    for bad in ("one string", [b"bytes"], [None]):
        with pytest.raises(TypeError, match="string"):
            store.record(KEY, PLAIN, ResultMetrics(score=9.0), prompts=bad)
    assert len(store.history(KEY)) == 1 and store.best(KEY).score == 1.0


def test_a_failed_record_leaves_no_prompt_rows(store: Storage, monkeypatch):
    import autotune.store.storage as storage_module

    store.record(KEY, PLAIN, ResultMetrics(score=2.0), prompts=["kept"])

    def boom(*args, **kwargs):
        raise RuntimeError("crash after the prompt rows, before the best row")

    monkeypatch.setattr(storage_module, "_offer_best", boom)
    with pytest.raises(RuntimeError, match="crash after the prompt rows"):
        store.record(KEY, Strategy(), ResultMetrics(score=99.0), prompts=["lost 1", "lost 2"])
    monkeypatch.undo()
    assert [e.score for e in store.history(KEY)] == [2.0]
    assert _prompt_rows(store.url) == 1 and store.prompts(store.best(KEY).history_id) == ["kept"]


def test_routes_are_the_best_rows_of_one_model_draft_and_hardware(store: Storage):
    scope = (KEY.model_id, KEY.model_revision, KEY.draft_id, KEY.hardware)
    code = StrategyKey(KEY.model_id, KEY.model_revision, "", "humaneval", KEY.hardware)
    elsewhere = [StrategyKey(KEY.model_id, KEY.model_revision, "draft", "gsm8k", KEY.hardware),
                 StrategyKey(KEY.model_id, KEY.model_revision, "", "gsm8k", "other-cpu"),
                 StrategyKey(KEY.model_id, "other-revision", "", "gsm8k", KEY.hardware)]
    assert store.routes(*scope) == [] and store.version(*scope) == ()
    store.record(KEY, PLAIN, ResultMetrics(score=2.0), prompts=["math 1", "math 2"])
    store.record(code, Strategy(draft_length=6), ResultMetrics(score=3.0), prompts=["def f():"])
    version = store.version(*scope)
    for key in elsewhere:
        store.record(key, Strategy(), ResultMetrics(score=9.0), prompts=["elsewhere"])
    store.record(KEY, Strategy(), ResultMetrics(score=1.0), prompts=["worse: not the best"])
    assert store.version(*scope) == version  # nothing the router reads changed
    routes = store.routes(*scope)
    assert [(b.key.task, p) for b, p in routes] == [("gsm8k", ["math 1", "math 2"]), ("humaneval", ["def f():"])]
    assert [b for b, _ in routes] == [store.best(KEY), store.best(code)]

    store.record(KEY, Strategy(draft_length=3), ResultMetrics(score=5.0), prompts=["math 3"])
    replaced = store.version(*scope)
    assert replaced != version and dict((b.key.task, p) for b, p in store.routes(*scope))["gsm8k"] == ["math 3"]
    store.delete(store.best(code).id)
    assert store.version(*scope) not in (version, replaced)
    assert [b.key.task for b, _ in store.routes(*scope)] == ["gsm8k"]


def test_a_database_from_before_stored_prompts_gains_the_table(store_url):
    with open_storage(store_url) as storage:
        storage.record(KEY, PLAIN, ResultMetrics(score=1.0))
    engine = create_engine(store_url)
    with engine.begin() as conn:
        conn.execute(text("DROP TABLE autotune_prompts"))
    engine.dispose()
    with open_storage(store_url) as storage:
        [(best, prompts)] = storage.routes(KEY.model_id, KEY.model_revision, KEY.draft_id, KEY.hardware)
        assert best.score == 1.0 and prompts == []  # an old result: no prompts, so it cannot be routed to
        hid = storage.record(KEY, Strategy(), ResultMetrics(score=2.0), prompts=["new"])
        assert storage.prompts(hid) == ["new"]


@pytest.mark.parametrize("bad", [
    dict(score=float("nan")), dict(score=1.0, acceptance=1.5), dict(score=1.0, measured_tps=-1.0),
    dict(score=1.0, tuning_share=2.0), dict(score="fast"), dict(score=1.0, study_name=3),
])
def test_metrics_are_validated(bad):
    with pytest.raises(StorageError, match=next(iter(k for k in bad if k != "score"), "score")):
        ResultMetrics(**bad)


def test_keys_are_validated():
    with pytest.raises(StorageError, match="model_id"):
        StrategyKey("", "r", "", "t", "hw")
    with pytest.raises(StorageError, match="task"):
        StrategyKey("m", "r", "", "x" * 300, "hw")


def test_unreadable_stored_strategy_names_the_row(store: Storage):
    store.record(KEY, PLAIN, ResultMetrics(score=1.0))
    engine = create_engine(store.url)
    with engine.begin() as conn:
        conn.execute(text("UPDATE autotune_best SET strategy = '{\"schema_version\": 99}'"))
    engine.dispose()
    [row] = store.list_best()
    with pytest.raises(StrategyError, match=f"stored strategy {row.id}"):
        row.strategy


# ---------------------------------------------------------------------- opening
def test_default_url_env_then_user_data_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("AUTOTUNE_STORAGE", "sqlite:////somewhere/x.db")
    assert default_storage_url() == "sqlite:////somewhere/x.db"
    monkeypatch.delenv("AUTOTUNE_STORAGE")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    url = default_storage_url()
    assert url == f"sqlite:///{tmp_path / 'data' / 'autotune' / 'autotune.db'}"
    assert (tmp_path / "data" / "autotune").is_dir()
    with open_storage(None) as storage:
        assert storage.list_best() == []
    assert (tmp_path / "data" / "autotune" / "autotune.db").exists()


@pytest.mark.parametrize("url,needle", [
    ("not a url", "malformed"),
    ("nosuchdb://x/y", "unknown database driver 'nosuchdb'"),
    ("postgresql://x@127.0.0.1:1/db", "cannot open storage postgresql://x@127.0.0.1:1/db"),
    ("postgresql://x:secret@127.0.0.1:1/db", "***"),
])
def test_open_errors_are_one_clear_line(url, needle):
    with pytest.raises(StorageError) as info:
        open_storage(url)
    message = str(info.value)
    assert needle in message and "\n" not in message and "secret" not in message


def test_sqlite_in_a_missing_directory(tmp_path):
    with pytest.raises(StorageError, match="directory exists"):
        open_storage(f"sqlite:///{tmp_path / 'no' / 'such' / 'dir.db'}")
    assert not (tmp_path / "no").exists()


def test_sqlite_uses_wal(tmp_path):
    open_storage(f"sqlite:///{tmp_path / 'w.db'}").close()
    import sqlite3

    with sqlite3.connect(tmp_path / "w.db") as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_optuna_studies_live_in_the_same_database(store: Storage):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(storage=store.optuna_storage(), study_name="tune-gsm8k", load_if_exists=True)
    study.optimize(lambda trial: trial.suggest_int("draft_length", 1, 8), n_trials=3)
    again = optuna.create_study(storage=store.optuna_storage(), study_name="tune-gsm8k", load_if_exists=True)
    assert len(again.trials) == 3
    store.record(KEY, PLAIN, ResultMetrics(score=1.0, study_name="tune-gsm8k"))
    assert store.best(KEY).study_name == "tune-gsm8k"


def test_hardware_fingerprint_is_stable():
    import torch

    from autotune.store.hardware import hardware_fingerprint
    from runtime.errors import RuntimeUserError

    first = hardware_fingerprint("cpu")
    assert first == hardware_fingerprint("cpu") and torch.__version__ in first and len(first) < 200
    with pytest.raises(RuntimeUserError, match="unknown device"):
        hardware_fingerprint("warp-drive")


# ---------------------------------------------------------------------- processes
WORKER = """
import json, os, random, sys, time
from autotune.store.storage import ResultMetrics, StrategyKey, open_storage
from search_spaces.strategy import Strategy
url, worker, count, go = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
key = StrategyKey(*json.loads(sys.argv[5]))
rng = random.Random(worker)
storage = open_storage(url)
open(f"{go}.ready{worker}", "w").close()
while not os.path.exists(go):
    time.sleep(0.002)
scores = []
i = 0
while count == 0 or i < count:
    score = rng.uniform(0.0, 100.0)
    storage.record(key, Strategy(draft_length=1 + i % 64), ResultMetrics(score=score, study_name=f"w{worker}"),
                   prompts=[f"w{worker} r{i} p{j}" for j in range(3)])
    scores.append(score)
    i += 1
print(json.dumps(scores))
"""


def _start_worker(url: str, worker: int, count: int, go: Path) -> subprocess.Popen:
    key = json.dumps([KEY.model_id, KEY.model_revision, KEY.draft_id, KEY.task, KEY.hardware])
    return subprocess.Popen(
        [sys.executable, "-c", WORKER, url, str(worker), str(count), str(go), key],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def test_two_processes_record_concurrently(store_url, tmp_path):
    open_storage(store_url).close()
    go = tmp_path / "go"
    workers = [_start_worker(store_url, w, 50, go) for w in (1, 2)]
    deadline = time.monotonic() + 120
    while not all(Path(f"{go}.ready{w}").exists() for w in (1, 2)):  # both connected: start together
        assert all(p.poll() is None for p in workers) and time.monotonic() < deadline
        time.sleep(0.01)
    go.touch()
    scores = []
    for proc in workers:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        scores += json.loads(out)
    with open_storage(store_url) as storage:
        history = storage.history(KEY)
        best = storage.best(KEY)
    assert len(history) == 100 and len({e.id for e in history}) == 100
    assert sorted(e.score for e in history) == sorted(scores)
    assert best.score == max(scores)
    assert {e.study_name for e in history} == {"w1", "w2"}  # (SQLite may let one writer finish first)


def _assert_consistent(url: str) -> int:
    engine = create_engine(url)
    with engine.connect() as conn:
        if engine.dialect.name == "sqlite":
            assert conn.execute(text("PRAGMA integrity_check")).scalar() == "ok"
        nulls = " OR ".join(f"{c} IS NULL" for c in REQUIRED)
        assert conn.execute(text(f"SELECT count(*) FROM autotune_history WHERE {nulls}")).scalar() == 0
        # every result has all three of its prompts, and no prompt row outlives a rolled-back result
        per_result = conn.execute(text(
            "SELECT h.id, count(p.id) FROM autotune_history h LEFT JOIN autotune_prompts p ON p.history_id = h.id "
            "GROUP BY h.id")).all()
        assert {n for _, n in per_result} <= {3}
        orphans = "SELECT count(*) FROM autotune_prompts WHERE history_id NOT IN (SELECT id FROM autotune_history)"
        assert conn.execute(text(orphans)).scalar() == 0
    engine.dispose()
    with open_storage(url) as storage:
        history = storage.history(KEY)
        best = storage.best(KEY)
    for entry in history:
        entry.strategy  # every row parses
    if history:
        top = max(e.score for e in history)
        assert best is not None and best.score == top
        [source] = [e for e in history if e.id == best.history_id]
        assert source.score == top and source.strategy_json == best.strategy_json
    else:
        assert best is None
    return len(history)


def test_sigkill_while_recording_leaves_a_consistent_store(store_url, tmp_path):
    open_storage(store_url).close()
    go = tmp_path / "go"
    go.touch()
    seen = 0
    for round_ in range(3):
        proc = _start_worker(store_url, 10 + round_, 0, go)
        deadline = time.monotonic() + 120
        with open_storage(store_url) as storage:
            while len(storage.history(KEY)) < seen + 15:
                assert proc.poll() is None, proc.stderr.read()
                assert time.monotonic() < deadline, "worker made no progress"
                time.sleep(0.02)
        time.sleep(0.013 * round_)  # vary where in its transaction the worker dies
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGKILL
        seen = _assert_consistent(store_url)
    assert seen >= 45


TUNER_WORKER = r"""
import os, sys, time
import optuna
from autotune.store.storage import open_storage
url, worker, count, go = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
optuna.logging.set_verbosity(optuna.logging.WARNING)
storage = open_storage(url)
study = optuna.create_study(study_name="shared", storage=storage.optuna_storage(), direction="maximize",
                            load_if_exists=True, sampler=optuna.samplers.RandomSampler(seed=worker))
open(f"{go}.ready{worker}", "w").close()
while not os.path.exists(go):
    time.sleep(0.002)
for _ in range(count):  # what the online tuner does between decode rounds: ask, score, tell
    trial = study.ask()
    x = trial.suggest_int("draft_length", 2, 12)
    trial.set_user_attr("worker", worker)
    study.tell(trial, float(x))
"""


def test_two_processes_tune_one_optuna_study_concurrently(store_url, tmp_path):
    open_storage(store_url).close()
    go = tmp_path / "go"
    workers = [
        subprocess.Popen([sys.executable, "-c", TUNER_WORKER, store_url, str(w), "40", str(go)], cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for w in (1, 2)
    ]
    deadline = time.monotonic() + 120
    while not all(Path(f"{go}.ready{w}").exists() for w in (1, 2)):
        dead = [p for p in workers if p.poll() is not None]
        assert not dead and time.monotonic() < deadline, dead and dead[0].communicate()[1]
        time.sleep(0.01)
    go.touch()
    for proc in workers:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
    import optuna

    with open_storage(store_url) as storage:
        study = optuna.load_study(study_name="shared", storage=storage.optuna_storage())
        trials = study.get_trials(deepcopy=False)
    assert len(trials) == 80 and len({t.number for t in trials}) == 80
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    assert sorted(t.user_attrs["worker"] for t in trials) == [1] * 40 + [2] * 40


def test_a_best_stored_only_at_another_precision_is_named_with_the_command_that_re_tunes(store: Storage):
    """Strategies are kept per precision (the model id names it): asking for ``best`` at gguf where
    only an int4 study was stored names int4 and the study command, rather than a bare miss."""
    from autotune.store.resolve import resolve_strategy

    int4 = StrategyKey(f"{KEY.model_id}#int4", KEY.model_revision, "", KEY.task, KEY.hardware)
    store.record(int4, PLAIN, ResultMetrics(score=1.0))
    gguf = StrategyKey(f"{KEY.model_id}#gguf", KEY.model_revision, "", KEY.task, KEY.hardware)
    with pytest.raises(StorageError, match=r"at precision gguf, only at int4; re-tune at this precision with "
                                           r"`autotune study --model smollm2-135m --task gsm8k --precision gguf`"):
        resolve_strategy("best", store, gguf, PLAIN)
    other_task = StrategyKey(gguf.model_id, KEY.model_revision, "", "humaneval", KEY.hardware)
    with pytest.raises(StorageError, match="no tuned strategy stored for model .*#gguf task humaneval on this hardware; run"):
        resolve_strategy("best", store, other_task, PLAIN)


def test_cost_timings_are_kept_per_model_draft_hardware_and_shape(store: Storage):
    """The tuner's cost-model timings: kept for a key's model, draft and hardware (any task) and
    shape, replaced by the next keep, apart for another shape or draft."""
    store.keep_costs(KEY, "width 13 rows", {"plain": 0.08, "verify": 0.5})
    assert store.costs(KEY, "width 13 rows") == {"plain": 0.08, "verify": 0.5}
    other_task = StrategyKey(KEY.model_id, KEY.model_revision, KEY.draft_id, "humaneval", KEY.hardware)
    assert store.costs(other_task, "width 13 rows") == {"plain": 0.08, "verify": 0.5}  # not per task
    assert store.costs(KEY, "width 9 rows") is None
    other_draft = StrategyKey(KEY.model_id, KEY.model_revision, "another-draft", KEY.task, KEY.hardware)
    assert store.costs(other_draft, "width 13 rows") is None
    store.keep_costs(KEY, "width 13 rows", {"plain": 0.07})
    assert store.costs(KEY, "width 13 rows") == {"plain": 0.07}
    with pytest.raises(StorageError, match="cost shape"):
        store.keep_costs(KEY, "x" * 500, {})
