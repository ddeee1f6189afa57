"""A fault run of ``autotune serve`` (issue 27): real traffic while things go wrong around it.

A real server process (``autotune serve --adaptive``, SmolLM2-135M, an empty SQLite store) serves
``--requests`` chat requests from ``--clients`` client threads: mixed topics (code, maths,
translation, recipes, poems, history; the last two only in the second half, so new routes open
around the store lock), greedy and temperature 1.0, 16-48 tokens, a quarter of them streamed.
Meanwhile:

- a third of the requests (a seeded draw) **disconnect**: the client closes its connection after a
  random delay, before its answer (a short read timeout, or a stream closed early);
- 10 **bad bodies** are spread through the run; each must get a 4xx, never a 500;
- in the middle of the run (once a re-tune is under way, so that its write meets the lock) this
  process **locks the store** for ``--lock-s`` seconds (a ``sqlite3`` connection holding
  ``BEGIN EXCLUSIVE``) while traffic goes on: the server must keep answering 200;
- once the last request was sent (others still decoding or queued) the server gets **SIGTERM**:
  it must exit 0 within ``--grace``; requests still queued then may get 503 with Retry-After
  ("refused at drain", a stream: its ``shutting_down`` error event), which is not a loss.

The server's RSS (its process and any children, ``/proc``) is sampled every 0.5 s. The result:
requests served, disconnected, refused at drain, lost (no 200, no drain 503, no disconnect of
its own: must be 0), bad bodies answered 4xx (must be all), 500s (must be 0), answers while the
store was locked (must be some), the exit status and time from SIGTERM to exit (must be 0,
within the grace), and the peak RSS, the RSS after warm-up (25% of the requests finished), the
peak after it and the RSS at the end (those two must stay within ``RSS_TOLERANCE`` of the
warm-up figure). Exits 1 when a must fails.

    python tools/fault_run.py --requests 200 --clients 16 --lock-s 30 --json fault_run.json
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
if (ROOT.parent / "shared" / "data").is_dir():  # GSM8K's local copy, as the tests find it
    os.environ.setdefault("AUTOTUNE_DATA_DIR", str(ROOT.parent / "shared" / "data"))

from tests.helpers import MODEL, TRANSLATE, routing_texts  # noqa: E402

READY_S = 600.0  # the first start may dequantise the model into the cache
SAMPLE_S = 0.5  # RSS sampling period
WARMUP_SHARE = 0.25  # calls finished before the "after warm-up" RSS is read
# how far the RSS may rise after warm-up (its peak and its end): routes opened later build their
# decoders (up to worker.MAX_DECODERS) and re-tunes their tuning decoder; measured up to +9%
# (docs/benchmarks.md)
RSS_TOLERANCE = 0.15
DISCONNECT_SHARE = 1 / 3
DISCONNECT_DELAY_S = (0.1, 6.0)  # a departing client waits this long (uniform) before closing
STREAM_SHARE = 0.25
MAX_TOKENS = (16, 48)
LATE_TOPICS = ("poem", "history")  # only in the second half: new routes open around the store lock
LOCK_WAIT_S = 60.0  # at the midpoint, how long the lock waits for a re-tune to be under way
RELEASE_WATCH_S = 5.0  # writes landing this soon after the lock's end had waited for it
DRAIN_DELAY_S = 1.0  # SIGTERM this long after the last request was sent
STAYER_TIMEOUT = httpx.Timeout(60.0, read=900.0)  # a client that stays waits for its answer
CHAT = "/v1/chat/completions"
# the status an SSE error event stands for (its stream's headers said 200); others count as 500
SSE_STATUS = {"shutting_down": 503, "request_timeout": 504, "queue_full": 503}

RECIPES = [f"Give me a simple recipe using {s}, with the steps numbered." for s in (
    "eggs, feta and tomatoes", "pasta, peas and bacon", "rice, beans and peppers", "apples, oats and cinnamon",
    "chicken, honey and soy sauce", "cauliflower, curry paste and coconut milk", "bread, cheese and onions",
    "pumpkin, sage and butter",
)]
POEMS = [f"Write four lines of verse about {s}." for s in (
    "an autumn harbour", "a sleeping cat", "the smell of rain", "a forgotten letter", "city lights at dawn",
    "a paper boat", "the last tram home", "a winter orchard",
)]
HISTORY = [f"In a few sentences, explain {s}." for s in (
    "why the Roman Empire split into east and west", "what caused the French Revolution",
    "how the printing press changed Europe", "why the Silk Road mattered to trade",
    "what the Magna Carta established", "how the Industrial Revolution began in Britain",
    "why the Berlin Wall fell in 1989", "what the Meiji Restoration changed in Japan",
)]


# ---------------------------------------------------------------------- the traffic
@dataclass(frozen=True)
class Call:
    """One chat request of the run; ``leave_after``: its client closes the connection after so
    many seconds unless answered by then (None: it stays for the answer)."""

    index: int
    topic: str
    text: str
    temperature: float
    max_tokens: int
    stream: bool
    leave_after: float | None


@dataclass(frozen=True)
class BadBody:
    """A request the server must refuse with a 4xx."""

    name: str
    content: bytes


@dataclass
class Outcome:
    """What one request got. ``kind``: served, disconnected, drain (503 after SIGTERM), lost,
    bad_4xx or bad_other."""

    kind: str
    name: str
    bad: bool = False  # a bad body (not one of the calls)
    status: int | None = None
    code: str | None = None
    leaving: bool = False
    sent_at: float = 0.0
    at: float = 0.0  # when it was answered (or left)
    detail: str = ""


def topic_texts() -> dict[str, list[str]]:
    return {"code": routing_texts("humaneval", 20), "math": routing_texts("gsm8k", 20), "translate": TRANSLATE,
            "recipe": RECIPES, "poem": POEMS, "history": HISTORY}


def plan(n: int, rng: random.Random) -> list[Call]:
    """``n`` calls, drawn with ``rng``: topics, temperature, length, streaming and departures."""
    texts = topic_texts()
    early = [t for t in texts if t not in LATE_TOPICS]
    leaving = set(rng.sample(range(n), round(n * DISCONNECT_SHARE)))
    calls = []
    for i in range(n):
        topic = rng.choice(early if i < n // 2 else list(texts))
        calls.append(Call(i, topic, rng.choice(texts[topic]), rng.choice((0.0, 1.0)), rng.randint(*MAX_TOKENS),
                          rng.random() < STREAM_SHARE,
                          round(rng.uniform(*DISCONNECT_DELAY_S), 2) if i in leaving else None))
    return calls


def bad_bodies() -> list[BadBody]:
    """Ten kinds of bad request: each a 400, 404 or 413 (never a 500)."""
    hi = [{"role": "user", "content": "hi"}]

    def body(**fields: Any) -> bytes:
        return json.dumps({"model": MODEL, "messages": hi, "max_tokens": 4, **fields}).encode()

    return [
        BadBody("malformed JSON", b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user",'),
        BadBody("unknown role", body(messages=[{"role": "wizard", "content": "hi"}])),
        BadBody("logprobs: true", body(logprobs=True)),
        BadBody("65 stop strings", body(stop=[f"s{i}" for i in range(65)])),
        BadBody("body over 1 MiB", body(messages=[{"role": "user", "content": "a" * (1 << 20)}])),
        BadBody('strategy id "²"', body(autotune={"strategy": "²"})),
        BadBody("seed -1", body(seed=-1)),
        BadBody("unknown model", json.dumps({"model": "no-such-model", "messages": hi}).encode()),
        BadBody("no stored strategy 999", body(autotune={"strategy": "999"})),
        BadBody("max_tokens past the context", body(max_tokens=100_000)),
    ]


def schedule(calls: list[Call], bads: list[BadBody]) -> list[Call | BadBody]:
    """The calls in order with the bad bodies spread evenly between them (none last)."""
    at = {round((k + 0.5) * len(calls) / len(bads)): bad for k, bad in enumerate(bads)}
    out: list[Call | BadBody] = []
    for call in calls:
        if call.index in at:
            out.append(at[call.index])
        out.append(call)
    return out


# ---------------------------------------------------------------------- one client request
def chat_body(call: Call) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": call.text}], "max_tokens": call.max_tokens,
            "temperature": call.temperature, "stream": call.stream}


def _timeout(call: Call) -> httpx.Timeout:
    return STAYER_TIMEOUT if call.leave_after is None else httpx.Timeout(60.0, read=call.leave_after)


def _error_kind(status: int, code: str | None, retry_after: bool, at: float, sigterm_at: float | None) -> str:
    """A non-200 answer: a drain refusal (503 shutting_down after SIGTERM, with Retry-After unless
    streamed) or a loss."""
    drained = sigterm_at is not None and at >= sigterm_at
    return "drain" if status == 503 and code == "shutting_down" and retry_after and drained else "lost"


def send_plain(url: str, call: Call, sigterm_at: list[float]) -> Outcome:
    """A whole-answer call; a departing client's read timeout is its departure (nothing arrives
    before the answer)."""
    out = Outcome("lost", f"#{call.index} {call.topic}", leaving=call.leave_after is not None,
                  sent_at=time.monotonic())
    try:
        r = httpx.post(url + CHAT, json=chat_body(call), timeout=_timeout(call))
    except httpx.ReadTimeout:
        if call.leave_after is None:
            raise
        out.kind, out.at = "disconnected", time.monotonic()
        return out
    out.at, out.status = time.monotonic(), r.status_code
    if r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None:
        out.kind = "served"
        return out
    return _refused(out, r, sigterm_at)


def send_stream(url: str, call: Call, sigterm_at: list[float]) -> Outcome:
    """A streamed call: served once its final chunk and ``[DONE]`` arrived; a departing client
    closes the stream at its time, whatever it read by then."""
    out = Outcome("lost", f"#{call.index} {call.topic} (stream)", leaving=call.leave_after is not None,
                  sent_at=time.monotonic())
    leave_at = out.sent_at + call.leave_after if call.leave_after is not None else None
    try:
        with httpx.stream("POST", url + CHAT, json=chat_body(call), timeout=_timeout(call)) as r:
            out.status = r.status_code
            if r.status_code != 200:
                r.read()
                out.at = time.monotonic()
                return _refused(out, r, sigterm_at)
            _read_events(r, out, leave_at, sigterm_at)  # leaving the block closes the connection
    except httpx.ReadTimeout:
        if leave_at is None:
            raise
        out.kind, out.at = "disconnected", time.monotonic()
    return out


def _read_events(r: httpx.Response, out: Outcome, leave_at: float | None, sigterm_at: list[float]) -> None:
    """Read a stream's events into ``out`` until its end, an error event or ``leave_at``."""
    final = done = False
    for line in r.iter_lines():
        if leave_at is not None and time.monotonic() > leave_at:
            out.kind, out.at = "disconnected", time.monotonic()
            return
        data = line.removeprefix("data: ") if line.startswith("data: ") else None
        if data == "[DONE]":
            done = True
        elif data:
            event = json.loads(data)
            if "error" in event:  # the headers said 200 already: the event says what went wrong
                out.at, out.code, out.detail = time.monotonic(), event["error"]["code"], data[:300]
                out.status = SSE_STATUS.get(out.code, 500)
                out.kind = _error_kind(out.status, out.code, True, out.at, _first(sigterm_at))
                return
            final = final or event["choices"][0]["finish_reason"] is not None
    out.at = time.monotonic()
    out.kind = "served" if final and done else "lost"
    out.detail = "" if out.kind == "served" else f"stream ended without its final chunk (final={final}, done={done})"


def _refused(out: Outcome, r: httpx.Response, sigterm_at: list[float]) -> Outcome:
    """``out`` for a non-200 answer ``r``: a drain refusal or a loss."""
    out.code, out.detail = _error_code(r), r.text[:300]
    out.kind = _error_kind(r.status_code, out.code, "retry-after" in r.headers, out.at, _first(sigterm_at))
    return out


def send_bad(url: str, bad: BadBody) -> Outcome:
    out = Outcome("bad_other", bad.name, bad=True, sent_at=time.monotonic())
    r = httpx.post(url + CHAT, content=bad.content, headers={"Content-Type": "application/json"},
                   timeout=STAYER_TIMEOUT)
    out.at, out.status, out.code = time.monotonic(), r.status_code, _error_code(r)
    out.kind = "bad_4xx" if 400 <= r.status_code < 500 else "bad_other"
    out.detail = r.text[:200]
    return out


def _error_code(r: httpx.Response) -> str | None:
    try:
        return r.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


def _first(values: list[float]) -> float | None:
    return values[0] if values else None


# ---------------------------------------------------------------------- the server process
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(store: Path, port: int, grace_s: float, log: Path) -> tuple[subprocess.Popen, str]:
    """``autotune serve --adaptive`` in a child process, its output in ``log``; -> (process, URL)
    once ``/health`` says 200 (it answers 503 "loading" before)."""
    cmd = [sys.executable, "-m", "autotune.cli", "serve", "--model", MODEL, "--adaptive",
           "--storage", f"sqlite:///{store}", "--port", str(port), "--grace", str(grace_s)]
    with open(log, "wb") as sink:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} while starting:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the server was not ready within {READY_S:g} s:\n{log.read_text()}")


def metrics(url: str) -> dict[str, float]:
    """The server's Prometheus samples, ``name{labels}`` -> value."""
    lines = httpx.get(f"{url}/metrics", timeout=30).text.splitlines()
    return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in lines if ln and not ln.startswith("#")}


def stored_writes(url: str) -> int | None:
    """The server's ``autotune:store_writes_total{outcome="stored"}`` (None once it is gone)."""
    try:
        return int(metrics(url).get('autotune:store_writes_total{outcome="stored"}', 0))
    except httpx.HTTPError:
        return None


def live_retunes(url: str) -> int:
    try:
        return httpx.get(f"{url}/health", timeout=10).json().get("routes", {}).get("live_retunes", 0)
    except (httpx.HTTPError, ValueError):
        return 0


# ---------------------------------------------------------------------- memory
def _proc_kib(pid: int, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:  # it ended
        pass
    return 0


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for children in Path(f"/proc/{p}/task").glob("*/children"):
            try:
                todo += [int(c) for c in children.read_text().split()]
            except OSError:  # the thread or process ended meanwhile
                continue
    return out


def rss_kib(pid: int) -> int:
    """Resident memory of ``pid`` and its children, KiB."""
    return sum(_proc_kib(p, "VmRSS") for p in _tree(pid))


class RssSampler(threading.Thread):
    """Samples ``rss_kib(pid)`` every ``SAMPLE_S`` until ``stop``: ``samples`` = [(time, KiB)]."""

    def __init__(self, pid: int) -> None:
        super().__init__(name="rss-sampler", daemon=True)
        self.pid, self.samples, self.halt = pid, [], threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            kib = rss_kib(self.pid)
            if kib:
                self.samples.append((time.monotonic(), kib))
            self.halt.wait(SAMPLE_S)

    def stop(self) -> None:
        self.halt.set()
        self.join(5)


# ---------------------------------------------------------------------- the store lock
class StoreLock(threading.Thread):
    """Once ``go`` is set: wait (at most ``LOCK_WAIT_S``) for a re-tune to be under way, then hold
    ``BEGIN EXCLUSIVE`` on the store for ``seconds``; ``held`` = (start, end). ``landed``: the
    server's stored writes during the lock and in the ``RELEASE_WATCH_S`` after it (a write that
    met the lock lands after it)."""

    def __init__(self, store: Path, url: str, seconds: float) -> None:
        super().__init__(name="store-lock", daemon=True)
        self.store, self.url, self.seconds = store, url, seconds
        self.go = threading.Event()
        self.held: tuple[float, float] | None = None
        self.retune_live = False
        self.landed: tuple[int, int] | None = None

    def run(self) -> None:
        self.go.wait()
        deadline = time.monotonic() + LOCK_WAIT_S
        while not self.retune_live and time.monotonic() < deadline:
            self.retune_live = live_retunes(self.url) > 0
            time.sleep(0.25)
        conn = sqlite3.connect(self.store, timeout=120, isolation_level=None)
        try:
            conn.execute("BEGIN EXCLUSIVE")
            start, before = time.monotonic(), stored_writes(self.url)
            time.sleep(self.seconds)
            released = stored_writes(self.url)
            conn.execute("ROLLBACK")
            self.held = (start, time.monotonic())
        finally:
            conn.close()
        time.sleep(RELEASE_WATCH_S)
        after = stored_writes(self.url)
        if None not in (before, released, after):
            self.landed = (released - before, after - released)


# ---------------------------------------------------------------------- the run
class Traffic:
    """The client threads over one shared schedule, and what they got."""

    def __init__(self, url: str, items: list[Call | BadBody], n_calls: int, on_warm: Any, lock: StoreLock) -> None:
        self.url, self.n_calls, self.on_warm, self.lock = url, n_calls, on_warm, lock
        self.items: queue.Queue[Call | BadBody] = queue.Queue()
        for item in items:
            self.items.put(item)
        self.outcomes: list[Outcome] = []
        self.mutex = threading.Lock()
        self.sent = self.done = 0  # calls sent, calls finished
        self.all_sent = threading.Event()
        self.sigterm_at: list[float] = []
        self.started = 0.0

    def run(self, clients: int) -> list[threading.Thread]:
        self.started = time.monotonic()
        threads = [threading.Thread(target=self._client, name=f"client-{i}", daemon=True) for i in range(clients)]
        for t in threads:
            t.start()
        return threads

    def _client(self) -> None:
        while True:
            try:
                item = self.items.get_nowait()
            except queue.Empty:
                return
            self._sending(item)
            try:
                out = self._send(item)
            except Exception as exc:  # no answer, or one not understood, where one was due
                bad = isinstance(item, BadBody)
                out = Outcome("bad_other" if bad else "lost", _name(item), bad=bad, at=time.monotonic(),
                              detail=f"{type(exc).__name__}: {exc}")
            self._record(out)

    def _send(self, item: Call | BadBody) -> Outcome:
        if isinstance(item, BadBody):
            return send_bad(self.url, item)
        return (send_stream if item.stream else send_plain)(self.url, item, self.sigterm_at)

    def _sending(self, item: Call | BadBody) -> None:
        with self.mutex:
            if isinstance(item, Call):
                self.sent += 1
                if self.sent == self.n_calls // 2:
                    self.lock.go.set()
            if self.items.empty():
                self.all_sent.set()

    def _record(self, out: Outcome) -> None:
        """Keep ``out``; the call that ends the warm-up (``WARMUP_SHARE`` of them done) reads the RSS."""
        with self.mutex:
            self.outcomes.append(out)
            is_call = not out.bad
            self.done += is_call
            warmed = is_call and self.done == round(self.n_calls * WARMUP_SHARE)
        if warmed:
            self.on_warm()


def _name(item: Call | BadBody) -> str:
    return item.name if isinstance(item, BadBody) else f"#{item.index} {item.topic}"


def run(n: int, clients: int, lock_s: float, port: int, grace_s: float, seed: int, workdir: Path) -> dict[str, Any]:
    """One fault run (see the module docstring) -> its result dict."""
    rng = random.Random(seed)
    calls, bads = plan(n, rng), bad_bodies()
    store, log = workdir / "store.db", workdir / "server.log"
    proc, url = start_server(store, port or free_port(), grace_s, log)
    sampler, lock = RssSampler(proc.pid), StoreLock(store, url, lock_s)
    warm: dict[str, float] = {}
    traffic = Traffic(url, schedule(calls, bads), n, lambda: warm.update(at=time.monotonic(), kib=rss_kib(proc.pid)),
                      lock)
    try:
        sampler.start()
        lock.start()
        threads = traffic.run(clients)
        traffic.all_sent.wait()
        time.sleep(DRAIN_DELAY_S)
        before = _before_sigterm(url, proc.pid)
        traffic.sigterm_at.append(time.monotonic())
        proc.send_signal(signal.SIGTERM)
        status, exited = _wait_exit(proc, grace_s)
        for t in threads:
            t.join(60)
        lock.join(lock_s + LOCK_WAIT_S + 120)
        sampler.stop()
    finally:
        if proc.poll() is None:
            proc.kill()
    return summarise(traffic, lock, sampler, warm, before, status, exited, grace_s, lock_s, log)


def _before_sigterm(url: str, pid: int) -> dict[str, Any]:
    """The server's figures just before SIGTERM: metrics, queue depth, RSS and its high-water mark."""
    health = httpx.get(f"{url}/health", timeout=30).json()
    return {"metrics": metrics(url), "queue_depth": health["queue_depth"], "rss_kib": rss_kib(pid),
            "hwm_kib": _proc_kib(pid, "VmHWM"), "routes": health.get("routes", {})}


def _wait_exit(proc: subprocess.Popen, grace_s: float) -> tuple[int | None, float | None]:
    """-> (exit status, seconds from SIGTERM to exit); (None, None) when it outlived the grace by 30 s."""
    t0 = time.monotonic()
    try:
        status = proc.wait(grace_s + 30)
    except subprocess.TimeoutExpired:
        return None, None
    return status, round(time.monotonic() - t0, 2)


# ---------------------------------------------------------------------- the report
def summarise(traffic: Traffic, lock: StoreLock, sampler: RssSampler, warm: dict[str, float], before: dict[str, Any],
              status: int | None, exited: float | None, grace_s: float, lock_s: float, log: Path) -> dict[str, Any]:
    outs = traffic.outcomes
    calls, bads = [o for o in outs if not o.bad], [o for o in outs if o.bad]
    count = lambda kind, among=calls: sum(o.kind == kind for o in among)  # noqa: E731
    held = lock.held or (0.0, 0.0)
    m = before["metrics"]
    store_writes = {k: int(m.get(f'autotune:store_writes_total{{outcome="{k}"}}', 0))
                    for k in ("stored", "failed", "dropped")}
    after_warm = [kib for t, kib in sampler.samples if t >= warm.get("at", float("inf"))]
    return {
        "requests_sent": traffic.sent,
        "meant_to_disconnect": sum(o.leaving for o in calls),
        "served": count("served"),
        "disconnected": count("disconnected"),
        "refused_at_drain": count("drain"),
        "lost": count("lost") + traffic.sent - len(calls),  # a client thread still waiting lost its answer
        "lost_details": [asdict(o) for o in calls if o.kind == "lost"],
        "bad_bodies_sent": len(bads),
        "bad_bodies_4xx": count("bad_4xx", bads),
        "bad_bodies": {o.name: o.status for o in bads},
        "status_500": sum(o.status == 500 for o in outs),
        "server_500s": int(m.get('autotune:request_errors_total{status="500"}', 0)),
        "served_latency_s": _spread([o.at - o.sent_at for o in calls if o.kind == "served"]),
        "store_lock_s": round(held[1] - held[0], 1),
        "store_lock_window_s": [round(t - traffic.started, 1) for t in held],  # from the first request on
        "retune_live_at_lock": lock.retune_live,
        "writes_landed_during_and_after_lock": lock.landed,
        "served_during_lock": sum(o.kind == "served" and held[0] <= o.at <= held[1] for o in calls),
        "slowest_answer_during_lock_s": round(max((o.at - o.sent_at for o in calls if o.kind == "served"
                                                   and held[0] <= o.at <= held[1]), default=0.0), 1),
        "store_writes": store_writes,
        "routes_at_end": sorted(r for r in before["routes"] if r not in ("pending_unknown", "pending_clusters",
                                                                           "live_retunes")),
        "queue_depth_at_sigterm": before["queue_depth"],
        "wall_s": round(time.monotonic() - traffic.started, 1),
        "rss_peak_mib": _mib(max(before["hwm_kib"], max((k for _, k in sampler.samples), default=0))),
        "rss_after_warmup_mib": _mib(warm.get("kib", 0)),
        "rss_peak_after_warmup_mib": _mib(max(after_warm, default=0)),
        "rss_end_mib": _mib(before["rss_kib"]),
        "rss_samples": len(sampler.samples),
        "exit_status": status,
        "sigterm_to_exit_s": exited,
        "grace_s": grace_s,
        "lock_s_asked": lock_s,
        "server_log_errors": _log_errors(log),
        "outcomes": [{**asdict(o), "sent_at": round(o.sent_at - traffic.started, 2),
                      "at": round(o.at - traffic.started, 2)} for o in sorted(outs, key=lambda o: o.sent_at)],
    }


def _spread(values: list[float]) -> dict[str, float]:
    """Median, 90th percentile and maximum of ``values``, rounded."""
    xs = sorted(values) or [0.0]
    return {"p50": round(xs[len(xs) // 2], 2), "p90": round(xs[int(len(xs) * 0.9)], 2), "max": round(xs[-1], 2)}


def _mib(kib: float) -> float:
    return round(kib / 1024, 1)


def _log_errors(log: Path) -> list[str]:
    lines = log.read_text(errors="replace").splitlines()
    return [ln for ln in lines if any(w in ln for w in ("Traceback", "ERROR", "CRITICAL", "Error:"))][:20]


def failures(r: dict[str, Any]) -> list[str]:
    """The musts this result breaks (empty: all hold)."""
    bound = r["rss_after_warmup_mib"] * (1 + RSS_TOLERANCE)
    highest = max(r["rss_peak_after_warmup_mib"], r["rss_end_mib"])
    checks = [
        (r["lost"] == 0, f"{r['lost']} requests lost: {r['lost_details'][:3]}"),
        (r["status_500"] == 0 and r["server_500s"] == 0, f"500s: {r['status_500']} seen, {r['server_500s']} counted"),
        (r["bad_bodies_4xx"] == r["bad_bodies_sent"], f"bad bodies not answered 4xx: {r['bad_bodies']}"),
        (r["served_during_lock"] > 0, "nothing was served while the store was locked"),
        (r["exit_status"] == 0, f"exit status {r['exit_status']}"),
        (r["sigterm_to_exit_s"] is not None and r["sigterm_to_exit_s"] < r["grace_s"],
         f"SIGTERM to exit took {r['sigterm_to_exit_s']} s (grace {r['grace_s']} s)"),
        (0 < highest <= bound, f"RSS rose to {highest} MiB after warm-up, over {bound:.1f} MiB "
                               f"({r['rss_after_warmup_mib']} MiB + {RSS_TOLERANCE:.0%})"),
    ]
    return [why for ok, why in checks if not ok]


def table(r: dict[str, Any]) -> str:
    """The result as a markdown table (what docs/benchmarks.md shows)."""
    rows = [
        ("requests sent (16-48 tokens, mixed topics)", r["requests_sent"], ""),
        ("served (200)", r["served"], ""),
        ("disconnected by the client (of the third meant to)", f"{r['disconnected']} (of {r['meant_to_disconnect']})",
         ""),
        ("refused at drain (503 + Retry-After, after SIGTERM)", r["refused_at_drain"], ""),
        ("lost (stayed, got no 200 and no drain 503)", r["lost"], "0"),
        ("bad bodies answered 4xx", f"{r['bad_bodies_4xx']} of {r['bad_bodies_sent']}", "all"),
        ("500s", r["status_500"], "0"),
        ("store locked (BEGIN EXCLUSIVE), s", r["store_lock_s"], ""),
        ("served while the store was locked (slowest, s)",
         f"{r['served_during_lock']} ({r['slowest_answer_during_lock_s']})", "> 0"),
        ("store writes: stored / failed tries / dropped",
         " / ".join(str(r["store_writes"][k]) for k in ("stored", "failed", "dropped")), ""),
        (f"... landed during the lock / within {RELEASE_WATCH_S:g} s after it",
         " / ".join(map(str, r["writes_landed_during_and_after_lock"] or ("?", "?"))), ""),
        ("wall time, s", r["wall_s"], ""),
        ("peak RSS (whole run, start-up included), MiB", r["rss_peak_mib"], ""),
        ("RSS after warm-up (25% answered), MiB", r["rss_after_warmup_mib"], ""),
        ("peak RSS after warm-up, MiB", r["rss_peak_after_warmup_mib"], f"<= +{RSS_TOLERANCE:.0%}"),
        ("RSS at the end (before SIGTERM), MiB", r["rss_end_mib"], f"<= +{RSS_TOLERANCE:.0%}"),
        ("exit status", r["exit_status"], "0"),
        ("SIGTERM to exit, s", f"{r['sigterm_to_exit_s']} (queue depth {r['queue_depth_at_sigterm']})",
         f"< {r['grace_s']:g}"),
    ]
    lines = ["| figure | measured | must |", "|---|---|---|"]
    return "\n".join(lines + [f"| {a} | {b} | {c} |" for a, b, c in rows])


def measure(requests: int = 200, clients: int = 16, lock_s: float = 30.0, port: int = 0, grace_s: float = 20.0,
            seed: int = 27) -> dict[str, Any]:
    """One fault run in a temporary directory -> its result, with ``failures`` (the musts it breaks)
    and the server log's last lines."""
    with tempfile.TemporaryDirectory(prefix="fault-run-") as tmp:
        result = run(requests, clients, lock_s, port, grace_s, seed, Path(tmp))
        result["server_log_tail"] = (Path(tmp) / "server.log").read_text(errors="replace").splitlines()[-40:]
    result["failures"] = failures(result)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--lock-s", type=float, default=30.0, help="how long the store stays locked mid-run")
    ap.add_argument("--port", type=int, default=0, help="the server's port (0: a free one)")
    ap.add_argument("--grace", type=float, default=20.0, help="the server's --grace")
    ap.add_argument("--seed", type=int, default=27)
    ap.add_argument("--json", dest="json_out", type=Path, help="write the result here")
    args = ap.parse_args(argv)
    result = measure(args.requests, args.clients, args.lock_s, args.port, args.grace, args.seed)
    print(json.dumps({k: v for k, v in result.items() if k not in ("outcomes", "server_log_tail")}, indent=2))
    print(table(result))
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2) + "\n")
    if result["failures"]:
        print("server log (last lines):", *result["server_log_tail"], sep="\n", file=sys.stderr)
        print("FAILED:", *result["failures"], sep="\n- ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
