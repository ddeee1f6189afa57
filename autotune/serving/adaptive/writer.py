"""Store writes of adaptive serving, off the decode thread: one background writer, bounded retries.

The decode thread hands a re-tune's result over as a ``Write`` and goes on decoding; the writer
thread records it. A write that fails (a locked SQLite file, an unreachable PostgreSQL server) is
tried again after each of ``RETRY_DELAYS_S`` (about 30 s in all), then logged once and dropped:
the route goes on with its stored strategy, and its next re-tune writes afresh. A write that
hangs holds up only the writes queued behind it. After a write lands its ``then`` runs here too
(refit the router). At most ``MAX_PENDING`` writes wait; one more is dropped (logged). ``done`` is
set once a write landed or was dropped.

Metrics: ``autotune:store_writes_total{outcome}`` (``stored``, ``failed`` per failed attempt,
``dropped``) and the gauge ``autotune:store_writes_pending``.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

RETRY_DELAYS_S = (0.5, 1.0, 2.0, 4.0, 8.0, 15.0)  # waits before each retry: a store locked ~30 s still gets the row
MAX_PENDING = 32
CLOSE_WAIT_S = 5.0  # how long shutting down waits for pending writes
log = logging.getLogger("autotune.serve")


@dataclass(frozen=True)
class Write:
    """One result to store: ``record()`` -> its history row id; ``then(history_id)`` after it landed."""

    what: str  # for the log, e.g. "the re-tune of route humaneval"
    record: Callable[[], int]
    then: Callable[[int], None]
    done: threading.Event = field(default_factory=threading.Event)


class StoreWriter:
    """The writer thread (started at once; a daemon, so a hung store never holds up the exit)."""

    def __init__(self, metrics: Any, delays: tuple[float, ...] = RETRY_DELAYS_S, max_pending: int = MAX_PENDING) -> None:
        self.metrics, self.delays = metrics, delays
        self.queue: queue.Queue[Write | None] = queue.Queue(maxsize=max_pending)
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="autotune-store-writer", daemon=True)
        self._thread.start()

    def submit(self, write: Write) -> None:
        """Queue ``write`` (never blocks: with ``MAX_PENDING`` waiting it is dropped and logged)."""
        try:
            self.queue.put_nowait(write)
        except queue.Full:
            log.error("store writes are backed up (%d waiting); %s is dropped", self.queue.maxsize, write.what)
            self.metrics.store_writes.labels("dropped").inc()
            write.done.set()
        self.metrics.store_writes_pending.set(self.queue.qsize())

    def close(self, timeout: float = CLOSE_WAIT_S) -> None:
        """Write what is pending within ``timeout`` (no more retries after it is called)."""
        self._closing.set()
        try:
            self.queue.put(None, timeout=timeout)
        except queue.Full:
            return
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            write = self.queue.get()
            if write is None:
                return
            try:
                self._write(write)
            except Exception:  # a bug in a then(): the row is stored, the writer goes on
                log.exception("after storing %s", write.what)
            finally:
                write.done.set()
                self.metrics.store_writes_pending.set(self.queue.qsize())

    def _write(self, write: Write) -> None:
        error: Exception | None = None
        tries = 0
        for delay in (0.0, *self.delays):
            if tries and self._closing.wait(delay):  # shutting down: no more retries
                break
            tries += 1
            try:
                history_id = write.record()
            except Exception as exc:  # any failure of the store: retried, never raised to a request
                self.metrics.store_writes.labels("failed").inc()
                error = exc
                continue
            self.metrics.store_writes.labels("stored").inc()
            write.then(history_id)
            return
        self.metrics.store_writes.labels("dropped").inc()
        log.error("storing %s failed %d times, last with %s; dropped (the route keeps its stored strategy)",
                  write.what, tries, _first_line(error))


def _first_line(exc: Exception | None) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
