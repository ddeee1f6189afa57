"""`autotune serve` as a process under a supervisor (real SmolLM2, slow tier, over HTTP).

It listens while its models load (``/health`` 503 "loading", the API 503 with Retry-After), and
SIGTERM drains it: the waiting requests get 503 with ``Retry-After`` at once, the running one
finishes within ``--grace`` (or is stopped then, 503), and the process exits 0 within the grace.
"""
from __future__ import annotations

import concurrent.futures as cf
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.helpers import MODEL

# heavy: each test starts `autotune serve` as a process, which loads the model again, and waits out its drain
pytestmark = [pytest.mark.slow, pytest.mark.heavy]

COUNT = {"model": MODEL, "prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "temperature": 0}  # never meets EOS


@pytest.fixture(scope="module")
def store_url(tmp_path_factory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('drain') / 'store.db'}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(store_url: str, *args: str) -> tuple[subprocess.Popen, str, list]:
    """Start ``autotune serve``; -> (process, base URL, the /health answers seen until it was ready)."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "autotune.cli", "serve", "--model", MODEL, "--storage", store_url,
                             "--port", str(port), *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url, seen = f"http://127.0.0.1:{port}", []
    deadline = time.time() + 240
    while True:
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "the server never became ready"
        try:
            r = httpx.get(f"{url}/health", timeout=5)
        except httpx.HTTPError:
            time.sleep(0.02)
            continue
        seen.append((r.status_code, r.json()))
        if r.status_code == 200:
            return proc, url, seen
        if len(seen) == 1:  # the API answers too, while loading: 503 with Retry-After
            api = httpx.post(f"{url}/v1/completions", json={**COUNT, "max_tokens": 1}, timeout=5)
            seen.append((api.status_code, api.json(), api.headers.get("Retry-After")))
        time.sleep(0.02)


def _depth(url: str) -> int:
    return httpx.get(f"{url}/health", timeout=5).json()["queue_depth"]


def _post_timed(url: str, body: dict) -> tuple[httpx.Response, float]:
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    return r, time.monotonic()


def _wait_depth(url: str, depth: int) -> None:
    deadline = time.time() + 30
    while _depth(url) < depth:
        assert time.time() < deadline, f"the queue never reached {depth}"
        time.sleep(0.02)


def _wait_running(url: str, n: int) -> None:
    deadline = time.time() + 30
    while httpx.get(f"{url}/health", timeout=5).json()["running"] < n:
        assert time.time() < deadline, f"{n} requests never ran side by side"
        time.sleep(0.02)


def _tokens_for(url: str, seconds: float) -> int:
    """How many tokens this machine decodes in about ``seconds`` now (shared CPUs vary a lot)."""
    t0 = time.monotonic()
    r = httpx.post(f"{url}/v1/completions", json={**COUNT, "max_tokens": 24}, timeout=120)
    return max(12, min(400, int(r.json()["usage"]["completion_tokens"] / (time.monotonic() - t0) * seconds)))


def test_health_says_loading_then_sigterm_drains_and_exits_0(store_url):
    grace = 60.0  # the default is 20 s; a shared CPU's speed varies too much to finish within it reliably
    # one request at a time, so that three wait in the queue (batched, they would be running: see
    # test_sigterm_lets_the_running_batch_finish)
    proc, url, seen = _start(store_url, "--grace", str(grace), "--max-queue", "8", "--max-batch", "1")
    try:
        # listening before the model is ready: /health and the API say "loading", not "refused"
        assert seen[0] == (503, {"status": "loading"}), seen
        assert seen[1][0] == 503 and seen[1][1]["error"]["code"] == "loading" and seen[1][2], seen
        tokens = _tokens_for(url, 4.0)  # long enough to be running at SIGTERM, well within the grace
        with cf.ThreadPoolExecutor(4) as ex:
            running = ex.submit(_post_timed, url, {**COUNT, "max_tokens": tokens})
            _wait_depth(url, 1)
            time.sleep(0.3)  # decoding now
            queued = [ex.submit(_post_timed, url, {**COUNT, "max_tokens": tokens}) for _ in range(3)]
            _wait_depth(url, 4)
            assert not running.done(), "the running request ended before SIGTERM: make it longer"
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            for fut in queued:
                r, at = fut.result()
                assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text
                assert r.headers["Retry-After"] and at - sent < 1.0, (r.headers, at - sent)
            r, _ = running.result()
        assert r.status_code == 200, r.text  # it ran to its end
        out = r.json()
        assert out["choices"][0]["text"].strip() and out["usage"]["completion_tokens"] == tokens, out
        assert proc.wait(grace) == 0, proc.stderr.read()
        assert time.monotonic() - sent < grace
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigterm_lets_the_running_batch_finish(store_url):
    """Batched (the default), four requests run side by side at SIGTERM: all four finish within
    the grace period with their whole budget, then the process exits 0."""
    grace = 60.0
    proc, url, _ = _start(store_url, "--grace", str(grace), "--max-batch", "4")
    try:
        tokens = _tokens_for(url, 3.0)
        with cf.ThreadPoolExecutor(4) as ex:
            running = [ex.submit(_post_timed, url, {**COUNT, "max_tokens": tokens}) for _ in range(4)]
            _wait_running(url, 4)  # all four admitted to the batch (a queued one would get 503 at SIGTERM)
            time.sleep(0.3)
            assert not any(f.done() for f in running), "a request ended before SIGTERM: make them longer"
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            for fut in running:
                r, _ = fut.result()
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == tokens, r.text
        assert proc.wait(grace) == 0, proc.stderr.read()
        assert time.monotonic() - sent < grace
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigterm_stops_the_running_request_after_the_grace_period(store_url):
    grace = 1.0
    proc, url, _ = _start(store_url, "--grace", str(grace))
    try:
        with cf.ThreadPoolExecutor(1) as ex:
            running = ex.submit(_post_timed, url, {**COUNT, "max_tokens": 3000})
            _wait_depth(url, 1)
            time.sleep(0.3)
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            r, at = running.result()
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text
        assert r.headers["Retry-After"] and grace <= at - sent < grace + 3, at - sent  # at its next round
        assert proc.wait(grace + 10) == 0, proc.stderr.read()
        assert time.monotonic() - sent < grace + 5
    finally:
        if proc.poll() is None:
            proc.kill()
