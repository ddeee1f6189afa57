"""One decode worker per model: a thread that owns the loaded models and serves a bounded queue.

Requests are continuously batched: up to ``max_batch`` decode side by side, each with its own
strategy (its own decoder: drafter state, KV cache, generator), one round per step
(``runtime.batching.batch_round``: each drafts, then one target forward verifies every sequence's
rows). A request joins between steps (its prefill runs then, one at a time, in arrival order) and
leaves when it is done; a request decoding alone runs exactly ``Decoder.generate``'s round. A
routed request (``auto``) is driven by its own controller (``autotune.tuning.controller``): from
its route's strategy, it switches between rounds to what its own tokens show is fastest, and stops
speculating where that measured slower than plain decoding; explicit choices decode as asked. A
request that re-tunes its route decodes alone, driven by its tuner, while the batch waits. A
request whose client went away is skipped, or leaves the batch at the next step.

The worker is its parts, each with one job: the request queue (``request_queue``), the decoder
cache (``decoders``), the cost figures (``costs``) and the step planner that reads them
(``planner``), per-request control (``control``), and the loop on the decode thread (``loop``);
``startup.start_up`` readies it before it serves.

Its condition is what ``/health`` reports (``condition``): ``draining`` once ``drain`` was called
(SIGTERM: the waiting requests are answered 503 + Retry-After at once, the running ones have the
grace period to finish), ``worker_dead`` when the thread ended on something no request handler
can catch (a ``BaseException``: its request gets a 500, the waiting ones a 503, later ones a 503),
``failing`` after ``FAILING_AFTER`` decodes in a row failed with an internal error (a success
clears it), else None.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from autotune.serving.adaptive.source import DecoderSource
from autotune.serving.control import Control
from autotune.serving.costs import CostFigures
from autotune.serving.decoders import DecoderCache
from autotune.serving.jobs import Job
from autotune.serving.loop import Adapting, DecodeLoop
from autotune.serving.request_queue import RequestQueue
from autotune.serving.worker_config import FAILING_AFTER, Hooks, WorkerConfig
from autotune.tuning.cost_model import MeasuredCostModel
from autotune.tuning.load import RouteAcceptance
from runtime.decoding import Decoder
from runtime.pipeline import ModelPool
from runtime.prefix_cache import PrefixCache
from search_spaces.strategy import Strategy


@dataclass(frozen=True)
class SharedDecoders:
    """What a re-tune borrows from its worker (``adaptive.source.DecoderSource``)."""

    decoders: DecoderCache
    control: Control

    @property
    def verify_width(self) -> int:
        return self.decoders.verify_width

    def decoder(self, strategy: Strategy) -> Decoder:
        return self.decoders.decoder(strategy)

    def note_width(self, width: int) -> None:
        self.decoders.note_width(width)

    def shared_cost(self, decoder: Decoder) -> MeasuredCostModel | None:
        return self.control.cost(decoder) if self.control.settings is not None else None


class DecodeWorker:
    """The decode thread of one model and its bounded queue, built from its parts. ``adapt``
    builds the adaptive layer (``adaptive.Adapter``) from what it may use of the worker."""

    def __init__(self, pool: ModelPool, target: object, draft: str | None, config: WorkerConfig,
                 hooks: Hooks = Hooks(), adapt: Callable[[DecoderSource], Adapting] | None = None) -> None:
        self.target, self.config = target, config
        self.requests = RequestQueue(config.max_queue)
        prefix = PrefixCache(config.prefix_cache_bytes) if config.prefix_cache_bytes and not pool.compile else None
        self.decoders = DecoderCache(pool, target, draft, config.control, config.max_decoders, config.max_batch, prefix)
        self.figures = CostFigures(acceptance=RouteAcceptance(min_drafts=config.acceptance_min_drafts))
        self.control = Control(config.control, self.decoders, self.figures.acceptance)
        self.adapter = adapt(SharedDecoders(self.decoders, self.control)) if adapt is not None else None
        self.loop = DecodeLoop(config, hooks, self.requests, self.decoders, self.figures, self.control, self.adapter)
        self._thread = threading.Thread(target=self.loop.run, name="autotune-decode", daemon=True)

    @property
    def running(self) -> int:
        """Requests being decoded (prefills included)."""
        return self.loop.running

    @property
    def depth(self) -> int:
        """Requests waiting or being decoded."""
        return self.requests.waiting + self.running

    @property
    def failures(self) -> int:
        """Internal decode failures in a row."""
        return self.loop.failures

    def start(self) -> None:
        self._thread.start()

    def condition(self) -> str | None:
        """Why this worker cannot serve now (``draining``, ``worker_dead``, ``failing``), or None."""
        if self._dead():
            return "worker_dead"
        if self.requests.closing:
            return "draining"
        return "failing" if self.loop.failures >= FAILING_AFTER else None

    def _dead(self) -> bool:
        thread = self._thread
        return self.loop.died or (thread.ident is not None and not thread.is_alive() and not self.requests.ended)

    def check_room(self) -> None:
        """503 now when a job could not be queued: before its prompt is tokenised or its strategy
        looked up, so a full server spends nothing on the requests it refuses."""
        self.requests.check_room(self._dead())

    def submit(self, job: Job) -> None:
        self.requests.submit(job, self._dead())

    def withdraw(self, job: Job) -> None:
        """Cancel ``job``: out of the queue at once, or, when running, stopped at its next round."""
        self.requests.withdraw(job)

    def drain(self, grace_s: float) -> None:
        """Stop serving (SIGTERM): refuse new requests, answer the waiting ones 503 with
        Retry-After now, and let the running ones finish within ``grace_s`` (then they are answered
        503 at once and stop decoding at their next round); the thread ends after them. Safe to
        call again: a shorter grace wins. Call it from a thread that holds no lock of this worker."""
        self.requests.drain(grace_s, self.loop.running_jobs)

    def stop(self, timeout: float = 30.0) -> None:
        """Drain with no grace: the running requests stop at their next round; wait for the thread."""
        self.drain(0.0)
        if self._thread.is_alive():
            self._thread.join(timeout)
