"""`autotune serve` when things break inside it (real SmolLM2, slow tier, over HTTP).

``/health`` tells the truth: 503 when the decode worker died or the last decodes failed, never a
500 while adaptive traffic changes the routes under it. The store never holds up decoding nor
fails a request that decoded: a store that raises "database is locked" or hangs delays nothing
but its own write, which lands once the store is back. A re-tune that raises ends cleanly.

Faults are injected the only ways a client cannot: the worker's fault hook (``Hooks.fault``),
and the server's ``Storage`` object and the tuner, monkeypatched in this process.
"""
from __future__ import annotations

import concurrent.futures as cf
import sys
import threading
import time

import httpx
import pytest

from autotune.errors import StorageError
from autotune.serving.adaptive.clusters import PendingClusters
from autotune.serving.adaptive.settings import AdaptSettings
from autotune.serving.server import ServeConfig, build_server
from autotune.serving.worker_config import Hooks
from autotune.store.storage import open_storage
from autotune.tuning.tuner import OnlineTuner
from tests.helpers import MODEL, LiveServer, chat, metric
from tests.helpers import TRANSLATE as ALL_TRANSLATE  # the first 6 are enough here

# heavy: faults injected into live servers, one start-up per test (re-tunes on live traffic, a store locked or hung,
# /health hammered while threads switch every microsecond); no test here compares output
pytestmark = [pytest.mark.slow, pytest.mark.heavy]

TRANSLATE = ALL_TRANSLATE[:6]
RECIPES = [f"Suggest an easy dinner recipe with {s}, and list the steps in order." for s in (
    "chickpeas, spinach and garlic", "salmon, lemon and dill", "mushrooms, rice and thyme",
    "lentils, carrots and cumin", "tofu, ginger and broccoli", "potatoes, leeks and cream",
)]
OTHER = [f"Write a short poem about {s}." for s in (
    "a lighthouse", "the first snow", "an old bicycle", "a cup of tea", "the night train", "a lost key",
)]
HI = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


class Killed(BaseException):
    """What no request handler catches: it ends the decode thread."""


def _live(pool, url: str, hooks: Hooks = Hooks(), **cfg):
    storage = open_storage(url)
    return storage, LiveServer(build_server(ServeConfig(model=MODEL, storage=url, **cfg), storage, pool=pool,
                                            hooks=hooks))


def _health(live: LiveServer) -> httpx.Response:
    return httpx.get(f"{live.url}/health", timeout=30)



# ---------------------------------------------------------------------- /health
def test_health_is_503_after_failed_decodes_and_ok_again_after_a_success(pool, smollm, tmp_path):
    failing = True

    def fault(job):
        if failing:
            raise RuntimeError("a decode that fails")

    storage, live = _live(pool, f"sqlite:///{tmp_path / 'store.db'}", hooks=Hooks(fault=fault))
    with live:
        assert _health(live).status_code == 200
        for n in range(1, 4):
            r = httpx.post(f"{live.url}/v1/chat/completions", json=HI, timeout=60)
            assert r.status_code == 500, r.text
            health = _health(live)
            if n < 3:  # one or two failures may be the requests' own doing
                assert health.status_code == 200, (n, health.text)
        assert health.status_code == 503 and health.json()["status"] == "failing", health.text
        assert health.json()["consecutive_failures"] == 3
        failing = False
        assert httpx.post(f"{live.url}/v1/chat/completions", json=HI, timeout=60).status_code == 200
        assert _health(live).status_code == 200
    storage.close()


def test_a_killed_worker_makes_health_503_and_requests_503(pool, smollm, tmp_path):
    release = threading.Event()

    def fault(job):
        release.wait(30)
        raise Killed()

    storage, live = _live(pool, f"sqlite:///{tmp_path / 'store.db'}", hooks=Hooks(fault=fault))
    with live:
        url = f"{live.url}/v1/chat/completions"
        with cf.ThreadPoolExecutor(2) as ex:
            running = ex.submit(httpx.post, url, json=HI, timeout=60)
            deadline = time.time() + 30
            while _health(live).json()["queue_depth"] < 1:
                assert time.time() < deadline
                time.sleep(0.05)
            waiting = ex.submit(httpx.post, url, json=HI, timeout=60)
            while _health(live).json()["queue_depth"] < 2:
                assert time.time() < deadline
                time.sleep(0.05)
            release.set()
            assert running.result().status_code == 500  # its decode was under way: a server fault
            r = waiting.result()
            assert r.status_code == 503 and r.json()["error"]["code"] == "worker_dead", r.text
        health = _health(live)
        assert health.status_code == 503 and health.json()["status"] == "worker_dead", health.text
        r = httpx.post(url, json=HI, timeout=60)  # refused at once, never queued for no one
        assert r.status_code == 503 and r.json()["error"]["code"] == "worker_dead", r.text
    storage.close()


def test_health_hammered_during_unknown_traffic_never_fails(pool, smollm, tmp_path, monkeypatch):
    """Unknown traffic of three topics opens, grows, re-tunes and drops pending clusters while
    /health is read in a loop: every read is a 200 with the route figures.

    The race is real but its window is microseconds wide; it is widened here by making the
    counting of pending clusters pause at each cluster (threads switch there), so a /health that
    read the worker's live clusters would see them change under it every time."""
    def slow_sizes(self):
        out = {}
        for cid, texts in self.clusters.items():
            time.sleep(0.002)
            out[cid] = len(texts)
        return out

    monkeypatch.setattr(PendingClusters, "sizes", slow_sizes)
    settings = AdaptSettings(new_route_requests=2, retune_requests=1)
    storage, live = _live(pool, f"sqlite:///{tmp_path / 'store.db'}", adaptive=settings)
    statuses: list[int] = []
    stop = threading.Event()

    def hammer() -> None:
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                r = client.get(f"{live.url}/health")
                statuses.append(r.status_code)
                assert r.status_code != 200 or "pending_clusters" in r.json()["routes"]

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: races show
    try:
        with live:
            client = live.client()
            with cf.ThreadPoolExecutor(2) as ex:
                readers = [ex.submit(hammer) for _ in range(2)]
                for texts in zip(TRANSLATE, RECIPES, OTHER):
                    for text in texts:
                        _, ids, _ = chat(client, text, max_tokens=4)
                        assert ids
                stop.set()
                for reader in readers:
                    reader.result()
    finally:
        sys.setswitchinterval(interval)
        stop.set()
        storage.close()
    assert len(statuses) > 50 and set(statuses) == {200}, sorted(set(statuses))


# ---------------------------------------------------------------------- the store
class FaultyStore:
    """``Storage.record`` that raises "database is locked" or hangs (up to 60 s) while told to."""

    def __init__(self, record) -> None:
        self.real, self.mode, self.calls = record, "ok", 0
        self.back = threading.Event()  # ends a hang

    def record(self, *args, **kwargs):
        self.calls += 1
        if self.mode == "locked":
            raise StorageError("storage sqlite:///store.db failed: (sqlite3.OperationalError) database is locked")
        if self.mode == "hung":
            self.back.wait(60)
        return self.real(*args, **kwargs)


def _rows(storage) -> set[str]:
    return {b.key.task for b in storage.list_best()}


def _wait_for_row(storage, before: set[str], within: float) -> set[str]:
    deadline = time.time() + within
    while not (_rows(storage) - before):
        assert time.time() < deadline, "the re-tune's row never reached the store"
        time.sleep(0.1)
    return _rows(storage) - before


def _timed_chat(client, text: str, strategy: str = "auto") -> float:
    t0 = time.monotonic()
    got, ids, _ = chat(client, text, strategy, max_tokens=8)
    assert got and ids
    return time.monotonic() - t0


def test_a_locked_or_hung_store_never_stalls_or_fails_requests(pool, smollm, tmp_path, monkeypatch):
    settings = AdaptSettings(new_route_requests=2, retune_requests=1)
    storage, live = _live(pool, f"sqlite:///{tmp_path / 'store.db'}", adaptive=settings)
    faulty = FaultyStore(storage.record)
    monkeypatch.setattr(storage, "record", faulty.record)
    with live:
        client = live.client()
        for texts, mode in ((TRANSLATE, "locked"), (RECIPES, "hung")):
            before = _rows(storage)
            faulty.mode = mode
            calls = faulty.calls
            # two requests open a route's cluster, the third re-tunes it: its result is written
            for text in texts[:3]:
                assert _timed_chat(client, text) < 20
            deadline = time.time() + 10
            while faulty.calls == calls:  # the writer is at it (failing, or hung)
                assert time.time() < deadline, "the re-tune's result was never written"
                time.sleep(0.05)
            # meanwhile other requests take no longer than they would: other routes, and the same
            # topic (a new pending cluster, whose re-tune starts but stores nothing before the end)
            for text in OTHER[:2]:
                assert _timed_chat(client, text, "plain") < 10
            for text in texts[3:5]:
                assert _timed_chat(client, text) < 10
            assert not (_rows(storage) - before)  # nothing stored yet
            faulty.mode = "ok"
            faulty.back.set()  # the store is back: the write lands (retried, or unblocked)
            new = _wait_for_row(storage, before, within=20)
            assert len(new) == 1 and next(iter(new)).startswith("auto:"), new
            faulty.back.clear()
        assert metric(live.url, 'autotune:store_writes_total{outcome="failed"}') >= 1
        assert metric(live.url, 'autotune:store_writes_total{outcome="stored"}') == 2
        assert metric(live.url, "autotune:request_errors_total") == 0
    storage.close()


def test_a_retune_that_raises_ends_and_its_route_serves_on(pool, smollm, tmp_path, monkeypatch):
    settings = AdaptSettings(new_route_requests=3, retune_requests=2)
    storage, live = _live(pool, f"sqlite:///{tmp_path / 'store.db'}", adaptive=settings)

    def broken(self, *args, **kwargs):
        raise RuntimeError("the tuner broke")

    with live:
        client = live.client()
        infos = [chat(client, text, max_tokens=6)[2] for text in TRANSLATE[:3]]  # the third starts a re-tune
        assert [i["state"] for i in infos] == ["stored"] * 3
        monkeypatch.setattr(OnlineTuner, "start_prompt", broken)
        body = {"model": MODEL, "messages": [{"role": "user", "content": TRANSLATE[3]}], "max_tokens": 6}
        r = httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 500, r.text  # the request the re-tune broke on
        for text in TRANSLATE[4:6]:  # the route decodes on with its stored strategy
            _, ids, info = chat(client, text, max_tokens=6)
            assert ids and info["state"] == "stored" and info["route"] == "unknown", info
        assert _health(live).status_code == 200
    storage.close()
