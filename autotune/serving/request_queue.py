"""The decode worker's bounded request queue: submit, withdraw, drain, and the grace period's expiry."""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from autotune.serving.jobs import RETRY_AFTER_S, Job, shutting_down
from autotune.serving.protocol import ApiError


class RequestQueue:
    """Waiting requests, in arrival order; ``None`` queued after them is the stop sentinel."""

    def __init__(self, max_queue: int) -> None:
        self.jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self.closing = False  # ``drain`` was called: new requests are refused
        self.ended = False  # the stop sentinel is queued

    @property
    def waiting(self) -> int:
        return self.jobs.qsize()

    def check_room(self, dead: bool) -> None:
        """503 now when a job could not be queued (``dead``: the decode thread ended): before its
        prompt is tokenised or its strategy looked up, so a full server spends nothing on it."""
        if dead:
            raise ApiError(503, "this server cannot decode (its decode worker stopped); retry on another replica",
                           type_="server_error", code="worker_dead")
        if self.closing:
            raise shutting_down()
        if self.jobs.full():
            raise self._full()

    def submit(self, job: Job, dead: bool) -> None:
        self.check_room(dead)
        try:
            self.jobs.put_nowait(job)
        except queue.Full:  # filled since check_room
            raise self._full() from None

    def _full(self) -> ApiError:
        return ApiError(503, f"the request queue is full ({self.jobs.maxsize} waiting); retry shortly",
                        type_="server_error", code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})

    def next(self, block: bool) -> Job | None:
        """The next waiting job (waiting for one when ``block``); ``None``: the stop sentinel.
        Raises ``queue.Empty`` when none waits and ``block`` is false."""
        return self.jobs.get() if block else self.jobs.get_nowait()

    def withdraw(self, job: Job) -> None:
        """Cancel ``job``: out of the queue at once (its place is free for the next request), or,
        when it is running, stopped at its next round."""
        job.cancelled.set()
        with self.jobs.mutex:  # queue.Queue has no remove(); this is its own lock and condition
            waiting = self.jobs.queue
            for i, queued in enumerate(waiting):
                if queued is job:
                    del waiting[i]
                    self.jobs.not_full.notify()
                    break

    def drain(self, grace_s: float, running: Callable[[], list[Job]]) -> None:
        """Refuse new requests, answer the waiting ones 503 with Retry-After now, and after
        ``grace_s`` answer the ``running`` ones 503 (they stop at their next round); then queue the
        stop sentinel. Safe to call again: a shorter grace wins."""
        self.closing = True
        expiry = threading.Timer(max(grace_s, 0.0), expire, (running,))  # not at a round's end: rounds may be slow
        expiry.daemon = True
        expiry.start()
        self.refuse_waiting(shutting_down())
        if not self.ended:
            self.ended = True
            self.jobs.put(None)  # behind the running jobs: the queue is empty, so this never blocks long

    def refuse_waiting(self, err: ApiError) -> None:
        """Answer every waiting job ``err``; a stop sentinel taken out here is queued again by ``drain``."""
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is None:  # the stop sentinel: it goes back behind
                self.ended = False
                continue
            job.cancelled.set()
            job.emit("error", err)


def expire(running: Callable[[], list[Job]]) -> None:
    """The grace period is over: answer the running requests 503 now; they stop at their next round."""
    for job in running():
        if not job.cancelled.is_set():
            job.cancelled.set()
            job.emit("error", shutting_down("the server is shutting down and stopped this request after its "
                                            "grace period (--grace); retry"))
