"""The decode thread's loop: admit waiting requests between steps, prefill a prompt a chunk per step
(riding in the step's target forward where the target's rows are reusable, else alone before it),
and step the running batch (``runtime.batching.batch_round``), each request's controller and
planned draft first; answer each request as it leaves."""
from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

from autotune.serving.answers import after_round, complete
from autotune.serving.control import Control
from autotune.serving.costs import CostFigures
from autotune.serving.decoders import DecoderCache
from autotune.serving.jobs import Job, Prefilling, Running, decode_failed, live_keys, shutting_down, user_errors, \
    worker_dead
from autotune.serving.planner import plan_step
from autotune.serving.protocol import ApiError
from autotune.serving.request_queue import RequestQueue
from autotune.serving.worker_config import Hooks, WorkerConfig
from runtime.batching import Member, Rider, batch_round
from runtime.decoding import GenerationResult
from search_spaces.strategy import PLAIN

log = logging.getLogger("autotune.serve")


class Adapting(Protocol):
    """What the worker needs of adaptive serving (``adaptive.Adapter``): the loop's calls, start-up's
    (``width``, ``prepare``) and the server's (``describe``, ``close``)."""

    deferred: Any  # work left for after a request's answer (truthy while some waits)
    width: int  # the verify width its tuning decoders need

    def begin(self, job: Job) -> Any: ...
    def generate_retune(self, job: Job, retune: Any, after_round: Callable) -> GenerationResult: ...
    def decoded(self, job: Job, result: GenerationResult) -> None: ...
    def after_answer(self, skip: bool = False) -> None: ...
    def prepare(self) -> None: ...
    def describe(self) -> dict[str, Any]: ...
    def close(self) -> None: ...


class DecodeLoop:
    """Runs on the decode thread: everything here but ``running_jobs`` is called from it alone."""

    def __init__(self, config: WorkerConfig, hooks: Hooks, requests: RequestQueue, decoders: DecoderCache,
                 figures: CostFigures, control: Control, adapter: Adapting | None) -> None:
        self.config, self.hooks, self.requests, self.decoders = config, hooks, requests, decoders
        self.figures, self.control, self.adapter = figures, control, adapter
        self.failures = 0  # internal decode failures in a row
        self.died = False  # ended on what no request handler can catch
        self.batch: list[Running] = []  # the running batch
        self.solo: Job | None = None  # a request decoding alone (a re-tune's), or being admitted
        self.prefilling: list[Prefilling] = []  # requests whose prompts are being prefilled, in admission order
        self._stop_seen = False
        self.leaving = False  # a request was answered and its bookkeeping runs (``_leave``)

    @property
    def running(self) -> int:
        """Requests being decoded, prefilled or admitted."""
        return len(self.batch) + len(self.prefilling) + int(self.solo is not None)

    def running_jobs(self) -> list[Job]:
        """The requests being decoded now (for the drain's expiry, on its timer thread)."""
        return [r.job for r in list(self.batch)] + [p.job for p in list(self.prefilling)] + (
            [self.solo] if self.solo is not None else [])

    def run(self) -> None:
        try:
            while self._fill():
                self._drop_withdrawn()
                if self.prefilling and not self._rides():  # the first prefill's next chunk alone, then the step
                    self._prefill(self.prefilling[0])
                if self.batch:
                    self._step()  # with the prefills' next chunks riding, where they can
                if self.adapter is not None:  # what a request left for after its answer (a re-tune's check and write)
                    self.adapter.after_answer(skip=self.requests.closing)
        except BaseException:  # nothing can go on after this: say so to everyone waiting
            self.died = True
            log.critical("the decode worker stopped; /health answers 503 from now on", exc_info=True)
            for job in self.running_jobs():
                job.emit("error", decode_failed())
            self.batch, self.prefilling, self.solo = [], [], None
            self.requests.refuse_waiting(worker_dead())

    def _fill(self) -> bool:
        """Admit waiting requests while the batch has room and the next step has prompt rows to
        spare (blocking while nothing runs) -> False once the worker should end (the stop sentinel
        was seen and nothing runs)."""
        while len(self.batch) + len(self.prefilling) < self.config.max_batch and self._room_to_prefill():
            # block for the next request only when there is nothing else to do
            idle = not self.batch and not self.prefilling and not self._stop_seen \
                and not (self.adapter is not None and self.adapter.deferred)
            try:
                job = self.requests.next(block=idle)
            except queue.Empty:
                break
            if job is None:
                self._stop_seen = True
                continue
            self._admit(job)
        return bool(self.batch) or bool(self.prefilling) or not self._stop_seen

    def _room_to_prefill(self) -> bool:
        """Whether another request may start its prefill: none is prefilling, or chunks ride the
        steps (the target's rows are reusable) and the next step's prompt rows are under the budget
        (one chunk's worth, ``prefill_chunk``: short prompts share a step, a long one takes it)."""
        if not self.prefilling:
            return True
        if not self.decoders.batch_target().rows_reusable:
            return False  # chunks run alone between steps: one prompt at a time
        return sum(p.chunk.rows for p in self.prefilling if p.chunk is not None) < self._budget()

    def _budget(self) -> int:
        """Prompt rows one step carries (its first rider's whole chunk, whatever its size)."""
        return self.prefilling[0].job.cfg.prefill_chunk if self.prefilling else 0

    def _admit(self, job: Job) -> None:
        """Start ``job``: its prefill, a chunk per step (riding the step where it can; its first now,
        alone, where nothing runs or chunks cannot ride); after its last chunk it joins the batch. A
        re-tune's request decodes whole, alone."""
        if job.cancelled.is_set():
            return
        if self.requests.closing:  # queued in the instant before a drain emptied the queue
            job.emit("error", shutting_down())
            return
        self.solo = job
        job.admitted_at = time.perf_counter()
        try:
            if self.hooks.fault is not None:
                self.hooks.fault(job)
            if self.decoders.servable(job.choice.strategy) is not None:  # logged once; lossless either way
                job.choice = replace(job.choice, strategy=PLAIN, label="plain", state="unservable")
            retune = None
            if self.adapter is not None and job.choice.state != "unservable":
                retune = self.adapter.begin(job)
            if retune is not None:
                adapter = self.adapter
                self._decode_alone(job, lambda after: adapter.generate_retune(job, retune, after))
                self.solo = None
                return
            strategy = job.choice.strategy
            dec = self.decoders.acquire(strategy)
            p = Prefilling(job, strategy, dec, dec.start_steps(job.ids, job.cfg))
            try:
                p.chunk = user_errors(next, p.steps)  # its prefix cache's rows and its first chunk, not yet run
            except BaseException:
                self.decoders.release(strategy, dec)
                raise
            job.prefill_at = time.perf_counter()
            self.prefilling.append(p)
        except ApiError as exc:
            self._fail(job, None, exc)
            self.solo = None
            return
        except Exception:  # a bug must not kill the worker: report it to this request only
            self.failures += 1
            log.exception("decoding a request failed")  # the details go to the log, never to the client
            self._fail(job, None, decode_failed())
            self.solo = None
            return
        self.solo = None  # not on a BaseException: the worker's end answers this request too
        if len(self.prefilling) == 1 and not self._rides():  # nothing to ride with: its first chunk now
            self._prefill(p)

    def _rides(self) -> bool:
        """Whether prompt chunks run in the batch's next step: a batch is running and its batched
        forward's target has reusable rows on the first prefill's own kernels (a chunk's rows come
        out bit for bit as its lone prefill's)."""
        if not self.batch:
            return False
        target = self.decoders.batch_target()
        first = self.prefilling[0].decoder.target if self.prefilling else target
        return target.rows_reusable and first.backend == target.backend

    def _riders(self) -> list[tuple[Prefilling, Rider]]:
        """The prefills whose next chunks ride the next step: in admission order, the first always,
        the others while the step's prompt rows stay within the budget; each on the batched target's
        own kernels (the target its decoder prefills alone with)."""
        if not self._rides():
            return []
        backend, budget, rows, out = self.decoders.batch_target().backend, self._budget(), 0, []
        for p in self.prefilling:
            if p.chunk is None or p.decoder.target.backend != backend or (out and rows + p.chunk.rows > budget):
                break
            rows += p.chunk.rows
            out.append((p, Rider(p.chunk)))
        return out

    def _drop_withdrawn(self) -> None:
        """Prefills whose requests were withdrawn (or stopped by a drain's grace) leave with their
        decoders and slots."""
        for p in [p for p in self.prefilling if p.job.cancelled.is_set()]:
            self.prefilling.remove(p)
            self.decoders.release(p.strategy, p.decoder)

    def _prefill(self, p: Prefilling, ran: tuple[Any, float] | None = None) -> None:
        """``p``'s next prompt chunk, alone (``ran`` None), or the logits and time share of its chunk
        that rode the step just run; after its last chunk, it joins the batch."""
        job, strategy, dec = p.job, p.strategy, p.decoder
        running: Running | None = None
        try:
            try:
                if (ran is not None or p.started) and self.hooks.on_prefill_chunk is not None:
                    self.hooks.on_prefill_chunk(ran is not None)
                p.started = True
                try:
                    p.chunk = user_errors(p.steps.send, ran)
                    return  # more chunks: the batch steps first (carrying the next where it rides)
                except StopIteration as done:
                    seq = done.value
            except BaseException:  # its decoder goes back; on the worker's end it stays listed, to be answered
                self.decoders.release(strategy, dec)
                raise
            job.prefilled_at = time.perf_counter()
            self.prefilling.remove(p)
            running = Running(job, Member(dec, seq), strategy, self.control.controller(job, strategy, dec))
            self.batch.append(running)
            if after_round(job, seq.out):
                self._leave(running)
        except ApiError as exc:
            self._unlist(p)
            self._fail(job, running, exc)
        except Exception:  # a bug must not kill the worker: report it to this request only
            self.failures += 1
            log.exception("decoding a request failed")  # the details go to the log, never to the client
            self._unlist(p)
            self._fail(job, running, decode_failed())

    def _unlist(self, p: Prefilling) -> None:
        if p in self.prefilling:
            self.prefilling.remove(p)

    def _step(self) -> None:
        """One round for every running request, the prefills' next chunks riding in its target
        forward where they can; the finished, stopped and departed ones leave."""
        batch = list(self.batch)
        riding = self._riders()
        riders = [rider for _, rider in riding]
        self.control.before_round(batch)
        for r, shape in zip(batch, plan_step(batch, self.figures, self.config.max_batch_rows, self.config.load_aware)):
            r.member.decoder.step_cap, r.member.decoder.step_width = shape.length, shape.width
        drafting = sum(r.member.seq.stats.draft_s for r in batch)
        drafted = [r.member.seq.stats.drafted for r in batch]
        try:
            self.sync_drafters(batch)  # timed as the requests' prefill, not the step's
            started = time.perf_counter()
            user_errors(batch_round, self.decoders.batch_target(), [r.member for r in batch], riders)
        except Exception as exc:  # which request's round failed is unknown: the step's requests fail
            if not isinstance(exc, ApiError):
                self.failures += 1
                log.exception("a batched decode step failed")
            for r in batch:
                self._fail(r.job, r, exc if isinstance(exc, ApiError) else decode_failed())
            for p, _ in riding:  # their chunks were in that forward
                self.prefilling.remove(p)
                self.decoders.release(p.strategy, p.decoder)
                p.job.emit("error", exc if isinstance(exc, ApiError) else decode_failed())
            return
        drafting_s = sum(r.member.seq.stats.draft_s for r in batch) - drafting
        if len(batch) > 1 and not riders:  # a decode step's target forward: the step's time, less its drafting
            forward_s = time.perf_counter() - started - drafting_s
            self.figures.step_cost.observe(sum(r.member.decoder.last_rows for r in batch), len(batch), forward_s)
        self.figures.observe_drafting(batch, [r.member.seq.stats.drafted - n for r, n in zip(batch, drafted)],
                                      drafting_s)
        if self.hooks.on_step is not None:
            self.hooks.on_step(batch)
        for r in batch:
            if after_round(r.job, r.member.seq.out) or r.member.seq.finished:
                self._leave(r)
        for p, c in riding:  # each chunk's logits to its prefill (after its last, it joins the batch)
            self._prefill(p, (c.logits, c.seconds))

    def sync_drafters(self, batch: list[Running]) -> None:
        """Before the first step a request drafts in, its drafting model runs over the prompt
        (``Decoder.draft_prefill``, timed as prefill), not at admission: a request that a loaded
        batch never lets draft never pays for it. What it cost is kept by drafter kind (the next
        request's start is priced at it)."""
        for r in batch:
            if not r.drafter_synced and r.member.decoder.step_cap != 0:
                seq = r.member.seq
                before = seq.stats.prefill_s
                ran = r.member.decoder.draft_prefill(seq)  # times itself, as prefill
                r.drafter_synced = True
                if ran:  # a catch-up that ran nothing (none needed) says nothing of its price
                    self.figures.observe_catch_up(r.current.drafter, ran, seq.stats.prefill_s - before)

    def _leave(self, r: Running) -> None:
        """``r`` is done (finished, stopped, or its client left): out of the batch, answered; then
        the bookkeeping its answer does not wait for (its rows kept for later prompts, its route's
        adaptive judgement): ``/health`` shows them a few milliseconds after the answer (``leaving``
        is set until then)."""
        self.leaving = True
        try:
            self._answer_and_keep(r)
        finally:
            self.leaving = False

    def _answer_and_keep(self, r: Running) -> None:
        self.batch.remove(r)
        self.figures.observe_finished(live_keys(r.job), r)  # its acceptance: where similar requests start
        result = None
        try:
            result = r.member.seq.result()
            self.control.finished(r, result.stats.wall_s - result.stats.prefill_s, self.hooks.on_control)
            if not r.job.cancelled.is_set():
                complete(r.job, result, self.hooks.on_done)
            self.failures = 0
        except ApiError as exc:
            r.job.emit("error", exc)
        except Exception:
            self.failures += 1
            log.exception("finishing a request failed")
            r.job.emit("error", decode_failed())
        try:  # its rows, for later requests that share its tokens (a chat's next turn)
            r.member.decoder.remember(r.member.seq)
        except Exception:  # answered already: a prefix cache that could not keep it loses nothing
            log.exception("keeping a request's rows in the prefix cache failed")
        self.decoders.release(r.strategy, r.member.decoder)
        if self.adapter is not None and result is not None:
            try:
                self.adapter.decoded(r.job, result)
            except Exception:
                log.exception("adaptive serving's bookkeeping after a request failed")

    def _fail(self, job: Job, running: Running | None, err: ApiError) -> None:
        if running is not None and running in self.batch:
            self.batch.remove(running)
            self.decoders.release(running.strategy, running.member.decoder)
        job.emit("error", err)

    def _decode_alone(self, job: Job, decode: Callable[[Callable[[list[int]], bool]], GenerationResult]) -> None:
        """Decode ``job`` whole, now, while the batch waits (a re-tune's tuner drives its rounds)."""
        result = user_errors(decode, lambda tokens: after_round(job, tokens))
        if not job.cancelled.is_set():
            complete(job, result, self.hooks.on_done)
        self.failures = 0
