"""One decode worker per model: a thread that owns the loaded models and serves a bounded queue.

Requests are decoded one at a time, in arrival order, by the same ``Decoder.generate`` that
``autotune generate`` runs (no second decode loop). Each strategy in use gets its decoder once
(built from the shared ``ModelPool``, so switching strategy between requests reloads nothing).
A request whose client went away is skipped, or stopped at the next round when it is running.

Its condition is what ``/health`` reports (``condition``): ``draining`` once ``drain`` was called
(SIGTERM: the waiting requests are answered 503 + Retry-After at once, the running one has the
grace period to finish), ``worker_dead`` when the thread ended on something no request handler
can catch (a ``BaseException``: its request gets a 500, the waiting ones a 503, later ones a 503),
``failing`` after ``FAILING_AFTER`` decodes in a row failed with an internal error (a success
clears it), else None.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from autotune.serving.protocol import ApiError
from autotune.serving.text import TextStream
from runtime.decoding import Decoder, GenerationConfig
from runtime.errors import RuntimeUserError
from runtime.pipeline import ModelPool, build_decoder
from runtime.stats import DecodeStats
from search_spaces.strategy import PLAIN, Strategy

MAX_DECODERS = 8  # decoders kept per worker (each holds its drafter's caches), least recently used out
RETRY_AFTER_S = 1  # what a 503 for a full queue, or from a draining server, suggests
FAILING_AFTER = 3  # internal decode failures in a row after which /health answers 503 ("failing")
HOLD_S = 2.0  # longest a finished request's answer waits for the store write its decode started
CHECK_HOLD_S = 60.0  # ... and, before that, for the result's check on the decode thread
log = logging.getLogger("autotune.serve")


@dataclass(frozen=True)
class Choice:
    """Which strategy a request decodes with, and why (the response's ``autotune`` object)."""

    route: str  # a task name, "unknown", or the override ("plain", "default", "id")
    strategy: Strategy
    label: str  # stored strategy id, "plain" or "default" ("tuning" while the route re-tunes)
    distance: float | None = None  # to the route's centroid (auto routing only)
    entry: Any = None  # the routed store entry (``router.RouteEntry``), when routed to one
    # "tuning" while the route re-tunes on live traffic (``adaptive``); "unservable" when this
    # server cannot run the stored strategy (``DecodeWorker.servable``): it decodes plainly
    state: str = "stored"


@dataclass
class Outcome:
    text: str
    tokens: list[int]
    stats: DecodeStats
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    ttft_s: float  # request accepted -> first token produced
    latency_s: float  # request accepted -> decoding done


Emit = Callable[[str, Any], None]  # (event, payload): ("delta", str), ("done", Outcome), ("error", ApiError)


@dataclass
class Job:
    ids: list[int]
    cfg: GenerationConfig
    choice: Choice
    stream: TextStream
    emit: Emit  # thread-safe: hands events to the request's event loop
    streamed: bool = False  # the client reads text deltas as they come (SSE)
    text: str = ""  # the request's routing text (what a route re-tuned or created stores)
    cancelled: threading.Event = field(default_factory=threading.Event)
    accepted_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    # set by the adaptive layer when this request completed a re-tune: its answer waits for the
    # result's check (at most CHECK_HOLD_S: the decode thread runs it, then the next request) and
    # store write (at most HOLD_S), so its client reads its own write; a slow or failing store
    # only delays this one answer
    hold: threading.Event | None = None
    checked: threading.Event | None = None  # set once that result was checked and handed to the writer


class DecodeWorker:
    """The decode thread of one model and its bounded queue."""

    def __init__(self, pool: ModelPool, target: Any, draft: str | None, max_queue: int,
                 on_done: Callable[[Job, Outcome], None] | None = None) -> None:
        self.pool, self.target, self.draft = pool, target, draft
        self.jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self.on_done = on_done
        self.adapter: Any = None  # ``adaptive.Adapter``: drift detection and re-tuning (serve --adaptive)
        self.decoders: OrderedDict[Strategy, Decoder] = OrderedDict()
        # one verify width for every speculative strategy: one packed copy of the target's weights
        # (a 1.5B fp32 target costs ~6 GiB per width); fixed once serving starts (``freeze_width``)
        self.verify_width = 0
        self.width_frozen = False
        self.widths: set[int] = set()  # the verify widths this worker's decoders were built for
        self.unservable: dict[Strategy, str] = {}  # strategies it cannot run, and why
        self.busy = False
        self.failures = 0  # internal decode failures in a row
        # a fault-injection point for tests, called on the decode thread before each request;
        # nothing reachable over HTTP sets it
        self.fault: Callable[[Job], None] | None = None
        self._closing = False
        self._running: Job | None = None
        self._ended = False  # the stop sentinel is queued
        self._died = False
        self._thread = threading.Thread(target=self._run, name="autotune-decode", daemon=True)

    @property
    def depth(self) -> int:
        """Requests waiting or being decoded."""
        return self.jobs.qsize() + int(self.busy)

    def start(self) -> None:
        self._thread.start()

    def condition(self) -> str | None:
        """Why this worker cannot serve now (``draining``, ``worker_dead``, ``failing``), or None."""
        if self._died or (self._thread.ident is not None and not self._thread.is_alive() and not self._ended):
            return "worker_dead"
        if self._closing:
            return "draining"
        return "failing" if self.failures >= FAILING_AFTER else None

    def check_room(self) -> None:
        """503 now when a job could not be queued: before its prompt is tokenised or its strategy
        looked up, so a full server spends nothing on the requests it refuses."""
        if self.condition() == "worker_dead":
            raise ApiError(503, "this server cannot decode (its decode worker stopped); retry on another replica",
                           type_="server_error", code="worker_dead")
        if self._closing:
            raise _shutting_down()
        if self.jobs.full():
            raise self._full()

    def submit(self, job: Job) -> None:
        self.check_room()
        try:
            self.jobs.put_nowait(job)
        except queue.Full:  # filled since check_room
            raise self._full() from None

    def _full(self) -> ApiError:
        return ApiError(503, f"the request queue is full ({self.jobs.maxsize} waiting); retry shortly",
                        type_="server_error", code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})

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

    def drain(self, grace_s: float) -> None:
        """Stop serving (SIGTERM): refuse new requests, answer the waiting ones 503 with
        Retry-After now, and let the running one finish within ``grace_s`` (then it is answered
        503 at once and stops decoding at its next round); the thread ends after it. Safe to call again: a shorter
        grace wins. Call it from a thread that holds no lock of this worker (not a signal handler)."""
        self._closing = True
        expiry = threading.Timer(max(grace_s, 0.0), self._expire)  # not at a round's end: rounds may be slow
        expiry.daemon = True
        expiry.start()
        self._refuse_waiting(_shutting_down())
        if not self._ended:
            self._ended = True
            self.jobs.put(None)  # behind the running job: the queue is empty, so this never blocks long

    def stop(self, timeout: float = 30.0) -> None:
        """Drain with no grace: the running request stops at its next round; wait for the thread."""
        self.drain(0.0)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _expire(self) -> None:
        """The grace period is over: answer the running request 503 now; it stops at its next round."""
        job = self._running
        if job is not None and not job.cancelled.is_set():
            job.cancelled.set()
            job.emit("error", _shutting_down("the server is shutting down and stopped this request after its "
                                             "grace period (--grace); retry"))

    def _refuse_waiting(self, err: ApiError) -> None:
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is None:  # the stop sentinel: it goes back behind
                self._ended = False
                continue
            job.cancelled.set()
            job.emit("error", err)

    def share_width(self, strategies: list[Strategy]) -> None:
        """Pad every speculative strategy's verify pass to the widest of ``strategies`` (at
        start-up, before ``freeze_width``)."""
        if self.width_frozen:
            raise RuntimeError("the verify width is fixed once the server serves")
        self.verify_width = max([self.verify_width] + [s.max_tree_nodes + 1 for s in strategies if s.speculates])

    def freeze_width(self) -> None:
        """From now on no strategy widens the verify pass: one packed copy of the target serves
        them all (a wider one stored later decodes plainly until a restart; ``servable``)."""
        self.width_frozen = True

    def servable(self, strategy: Strategy) -> str | None:
        """Why this server cannot decode ``strategy`` now (it then decodes plainly), or None."""
        if strategy in self.decoders or not strategy.speculates:
            return None
        if strategy in self.unservable:
            return self.unservable[strategy]
        why = None
        if self.width_frozen and self.verify_width and strategy.max_tree_nodes + 1 > self.verify_width:
            why = (f"it verifies {strategy.max_tree_nodes + 1} tokens a round and this server packed its target "
                   f"for {self.verify_width}; restart the server to serve it")
        else:
            try:
                self.decoder(strategy)
            except RuntimeUserError as exc:  # e.g. an int8 draft under --compile
                why = str(exc)
        if why is not None:
            self.unservable[strategy] = why
            log.warning("stored strategy %s cannot run on this server (%s); its requests decode plainly",
                        strategy.to_json(), why)
        return why

    def decoder(self, strategy: Strategy) -> Decoder:
        dec = self.decoders.get(strategy)
        if dec is None:
            width = None
            if strategy.speculates:
                width = max(self.verify_width, strategy.max_tree_nodes + 1)
                if self.width_frozen and self.verify_width and width > self.verify_width:
                    raise RuntimeUserError(f"verify width {width} is wider than this server's {self.verify_width}")
                self.verify_width = width  # the first speculative strategy of a server without one fixes it
            dec = build_decoder(self.pool, self.target, strategy, self._draft_for(strategy), verify_width=width)
            if width is not None:
                self.widths.add(width)
            self.decoders[strategy] = dec
            while len(self.decoders) > MAX_DECODERS:
                self.decoders.popitem(last=False)
        self.decoders.move_to_end(strategy)
        return dec

    def _draft_for(self, strategy: Strategy) -> str | None:
        return self.draft if strategy.drafter == "draft-model" else None

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            if job.cancelled.is_set():
                continue
            if self._closing:  # queued in the instant before a drain emptied the queue
                job.emit("error", _shutting_down())
                continue
            self.busy, self._running = True, job
            try:
                if self.fault is not None:
                    self.fault(job)
                self._decode(job)
                self.failures = 0
            except ApiError as exc:
                job.emit("error", exc)
            except Exception:  # a bug must not kill the worker: report it to this request only
                self.failures += 1
                log.exception("decoding a request failed")  # the details go to the log, never to the client
                job.emit("error", _decode_failed())
            except BaseException:  # nothing can go on after this: say so to everyone waiting
                self._died = True
                log.critical("the decode worker stopped; /health answers 503 from now on", exc_info=True)
                job.emit("error", _decode_failed())
                self._refuse_waiting(ApiError(503, "this server cannot decode (its decode worker stopped)",
                                              type_="server_error", code="worker_dead"))
                return
            finally:
                self.busy, self._running = False, None
            if self.adapter is not None:  # what a request left for after its answer (a re-tune's check and write)
                self.adapter.after_answer(skip=self._closing)

    def _decode(self, job: Job) -> None:
        # text is decoded between rounds only when someone reads it then: a streaming client, or
        # stop strings that may end decoding early; otherwise once, at the end
        per_round = job.streamed or bool(job.stream.stops)

        def after_round(tokens: list[int]) -> bool:
            if job.first_token_at is None:
                job.first_token_at = time.perf_counter()
            if per_round:
                self._release(job, job.stream.push(tokens))
            return job.stream.stopped or job.cancelled.is_set()

        if self.servable(job.choice.strategy) is not None:  # logged once; lossless either way
            job.choice = replace(job.choice, strategy=PLAIN, label="plain", state="unservable")
        try:
            if self.adapter is not None and job.choice.state != "unservable":
                result = self.adapter.generate(job, after_round)
            else:
                result = self.decoder(job.choice.strategy).generate(job.ids, job.cfg, after_round=after_round)
        except RuntimeUserError as exc:  # e.g. a stored strategy whose layer plan does not fit this model
            raise ApiError(400, str(exc), "autotune.strategy", code="strategy_unusable") from None
        if job.cancelled.is_set():
            return
        self._release(job, job.stream.push(result.tokens) + job.stream.finish())
        ended = job.stream.stopped or (result.tokens and result.tokens[-1] in job.cfg.eos_token_ids)
        now = time.perf_counter()
        outcome = Outcome(
            text=job.stream.text, tokens=list(result.tokens[: job.stream.n_tokens]), stats=result.stats,  # to the stop
            finish_reason="stop" if ended else "length",
            ttft_s=(job.first_token_at or now) - job.accepted_at, latency_s=now - job.accepted_at,
        )
        if self.on_done is not None:
            self.on_done(job, outcome)
        self._answer(job, outcome)

    @staticmethod
    def _answer(job: Job, outcome: Outcome) -> None:
        hold = job.hold
        if hold is None or hold.is_set():
            job.emit("done", outcome)
            return

        def answer_when_stored() -> None:  # off the decode thread: it goes on with the next request
            if job.checked is not None:
                job.checked.wait(CHECK_HOLD_S)
            hold.wait(HOLD_S)
            job.emit("done", outcome)

        threading.Thread(target=answer_when_stored, name="autotune-answer", daemon=True).start()

    @staticmethod
    def _release(job: Job, text: str) -> None:
        if text and job.streamed:
            job.emit("delta", text)


def _shutting_down(message: str = "the server is shutting down; retry on another replica") -> ApiError:
    return ApiError(503, message, type_="server_error", code="shutting_down",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def _decode_failed() -> ApiError:
    return ApiError(500, "decoding failed (internal error; see the server log)", type_="server_error",
                    code="decode_failed")
