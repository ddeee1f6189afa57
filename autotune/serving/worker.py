"""One decode worker per model: a thread that owns the loaded models and serves a bounded queue.

Requests are continuously batched: up to ``max_batch`` decode side by side, each with its own
strategy (its own decoder: drafter state, KV cache, generator), one round per step
(``runtime.batching.batch_round``: each drafts, then one target forward verifies every sequence's
rows). A request joins between steps (its prefill runs then, one at a time, in arrival order) and
leaves when it is done; a request decoding alone runs exactly ``Decoder.generate``'s round. A
routed request (``auto``) is driven by its own controller (``autotune.tuning.controller``): from
its route's strategy, it switches between rounds to what its own tokens show is fastest, and stops
speculating where that measured slower than plain decoding; explicit choices decode as asked. A
request that re-tunes its route decodes alone, driven by its tuner, while the batch waits. Decoders
are built from the shared ``ModelPool`` (the weights once), one per running request of a strategy.
A request whose client went away is skipped, or leaves the batch at the next step.

Its condition is what ``/health`` reports (``condition``): ``draining`` once ``drain`` was called
(SIGTERM: the waiting requests are answered 503 + Retry-After at once, the running ones have the
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
from collections.abc import Callable, Generator
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from autotune.serving.protocol import ApiError
from autotune.serving.routing.router import UNKNOWN
from autotune.serving.text import TextStream
from autotune.tuning.controller import ControlSettings, Corrections, RequestController, RoutePriors, \
    controller_cost, decoder_options, lookup_candidate
from autotune.tuning.cost_model import MeasuredCostModel
from autotune.tuning.load import DEFAULT_ACCEPTANCE, Candidate, CatchUpCost, DraftCost, RouteAcceptance, StepCost, \
    acceptance_estimate, choose_shapes, pays_alone, starts_alone, strategy_rows
from runtime.batching import Member, batch_round
from runtime.decoding import Decoder, GenerationConfig, GenerationResult, Sequence
from runtime.errors import RuntimeUserError
from runtime.pipeline import ModelPool, build_decoder, verify_packing
from runtime.slots import ROW_BUCKETS, SlotCache, row_bucket
from runtime.stats import DecodeStats
from runtime.transformer import BatchPart, CausalLM
from search_spaces.strategy import PLAIN, Strategy

EXPLICIT_ROUTES = ("plain", "default", "id")  # a client's explicit choice: decoded as asked, never switched
MAX_DECODERS = 8  # decoders kept per worker (each holds its drafter's caches), least recently used out
RETRY_AFTER_S = 1  # what a 503 for a full queue, or from a draining server, suggests
FAILING_AFTER = 3  # internal decode failures in a row after which /health answers 503 ("failing")
HOLD_S = 2.0  # longest a finished request's answer waits for the store write its decode started
CHECK_HOLD_S = 60.0  # ... and, before that, for the result's check on the decode thread
DRAFT_TOKEN_SHARE = 0.3  # a drafted token's price before any was timed, as a share of a one-row target step
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
    adapt: Any = None  # the adaptive layer's routing of this request (``Adapter.begin``)
    control: dict[str, Any] | None = None  # its controller's summary, once decoded (``RequestController.summary``)
    tuning: dict[str, Any] | None = None  # a re-tune's request: the tuning it carried (``Adapter.generate_retune``)


@dataclass
class Running:
    """A request in the running batch."""

    job: Job
    member: Member
    strategy: Strategy  # the one it started with (its decoder's key)
    control: RequestController | None = None  # drives its strategy between rounds (routed requests)
    drafter_synced: bool = False  # its drafting model has run over the prompt (``_sync_drafters``)

    @property
    def current(self) -> Strategy:
        """The strategy its next round decodes with."""
        return self.control.current if self.control is not None else self.strategy


@dataclass
class Prefilling:
    """A request whose prompt is being prefilled, a chunk between the batch's steps
    (``Decoder.start_steps``); it joins the batch after its last chunk."""

    job: Job
    strategy: Strategy
    decoder: Decoder
    steps: Generator[int, None, Sequence]
    started: bool = False  # its first chunk ran (at admission)


class DecodeWorker:
    """The decode thread of one model and its bounded queue."""

    def __init__(self, pool: ModelPool, target: Any, draft: str | None, max_queue: int,
                 on_done: Callable[[Job, Outcome], None] | None = None, max_batch: int = 1,
                 on_step: Callable[[list[Running]], None] | None = None, max_batch_rows: int | None = None) -> None:
        self.pool, self.target, self.draft = pool, target, draft
        self.max_batch = max_batch
        self.max_batch_rows = max_batch_rows  # target rows a step may verify (None: no limit)
        self.on_step = on_step  # after each batched step, with the requests it advanced (metrics)
        self.load_aware = True  # draft lengths shrink with load (``autotune.tuning.load``)
        self.step_cost = StepCost()  # a batched forward's price (``profile_steps``, then the real steps)
        # per-request control of routed requests (None: off, every request keeps its strategy)
        self.control: ControlSettings | None = ControlSettings()
        self.corrections = Corrections()  # measured / predicted speed per drafter kind, learned from every request
        self.priors = RoutePriors()  # where each route's requests start: what its latest requests ended on
        self.acceptance = RouteAcceptance()  # each route's live acceptance per strategy: the goodput choice's prior
        self._costs: dict[tuple, MeasuredCostModel] = {}  # the controllers' cost models, per drafting model and target
        self.on_control: Callable[[Job], None] | None = None  # after a controlled request decoded (metrics)
        self.draft_token_s: dict[str, float] = {}  # seconds per drafted token, by drafter kind
        # a drafting model's catch-up over a sequence (its prompt and first tokens,
        # ``_sync_drafters``), by drafter kind: what starting to draft costs a request
        self.catch_ups: dict[str, CatchUpCost] = {}
        # each draft model's depth forwards in a batched step (``profile_steps``, then the real steps),
        # by its weights (``draft_key``): one forward per depth for every sequence drafting there
        self.draft_costs: dict[str, DraftCost] = {}
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
        self.failures = 0  # internal decode failures in a row
        # a fault-injection point for tests, called on the decode thread before each request;
        # nothing reachable over HTTP sets it
        self.fault: Callable[[Job], None] | None = None
        self._closing = False
        self._batch: list[Running] = []  # the running batch
        self._solo: Job | None = None  # a request decoding alone (a re-tune's), or being admitted (its prefill)
        self._prefilling: Prefilling | None = None  # a long prompt's prefill, a chunk between steps (it is _solo)
        # after each prompt chunk run between batched steps (a long prompt's every chunk but its first; metrics)
        self.on_prefill_chunk: Callable[[], None] | None = None
        self._in_use: set[int] = set()  # ids of the decoders serving a running request
        self._spare: dict[Strategy, list[Decoder]] = {}  # more decoders per strategy, for batch-mates
        self._batch_target: tuple[int, CausalLM] | None = None  # (verify width, the wrapper batched steps run)
        # under serve --compile with batching: the K/V slots of the running sequences, so that a batched
        # step is one static-shape forward (``runtime.slots``; ``use_slots``)
        self.slots: SlotCache | None = None
        self._stop_seen = False
        self._ended = False  # the stop sentinel is queued
        self._died = False
        self._thread = threading.Thread(target=self._run, name="autotune-decode", daemon=True)

    @property
    def busy(self) -> bool:
        return bool(self._batch) or self._solo is not None

    @property
    def running(self) -> int:
        """Requests being decoded."""
        return len(self._batch) + int(self._solo is not None)

    @property
    def n_decoders(self) -> int:
        """Decoders kept (one per strategy, and spares for batch-mates of the same strategy)."""
        return len(self.decoders) + sum(len(v) for v in self._spare.values())

    @property
    def depth(self) -> int:
        """Requests waiting or being decoded."""
        return self.jobs.qsize() + self.running

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
        503 at once and stops decoding at its next round); the thread ends after them. Safe to call again: a shorter
        grace wins. Call it from a thread that holds no lock of this worker (not a signal handler)."""
        self._closing = True
        expiry = threading.Timer(max(grace_s, 0.0), self._expire)  # not at a round's end: rounds may be slow
        expiry.daemon = True
        expiry.start()
        self._refuse_waiting(_shutting_down())
        if not self._ended:
            self._ended = True
            self.jobs.put(None)  # behind the running jobs: the queue is empty, so this never blocks long

    def stop(self, timeout: float = 30.0) -> None:
        """Drain with no grace: the running requests stop at their next round; wait for the thread."""
        self.drain(0.0)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _expire(self) -> None:
        """The grace period is over: answer the running requests 503 now; they stop at their next round."""
        for job in [r.job for r in list(self._batch)] + [self._solo]:
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
            standby = self._standby(strategy, width)
            if standby and width is None:
                width = self.verify_width
            dec = build_decoder(self.pool, self.target, strategy, self._draft_for(strategy),
                                verify_width=width, standby=standby)
            if width is not None:
                self.widths.add(width)
            self.decoders[strategy] = dec
            while len(self.decoders) > MAX_DECODERS:
                self.decoders.popitem(last=False)
        self.decoders.move_to_end(strategy)
        return dec

    def control_strategies(self) -> list[Strategy]:
        """What per-request control adds to the strategies served (prompt lookup: every decoder
        keeps it on standby), for the verify width fixed at start-up."""
        if self.control is None:
            return []
        look = lookup_candidate(self.control.lookup_length, self.control.lookup_length + 1)
        return [look] if look is not None else []

    def _standby(self, strategy: Strategy, width: int | None) -> list[Strategy]:
        """Drafters a decoder of ``strategy`` keeps following the sequence for its controller:
        prompt lookup (no forward, a dict of n-grams), where the verify width leaves it room. (Not
        the server's default draft chain: measured on the Qwen pair at int4, letting every request
        reach it lost more than it won, docs/benchmarks.md, issue 30 run 2.)"""
        if self.control is None or strategy.drafter == "prompt-lookup":
            return []
        look = lookup_candidate(self.control.lookup_length, width or self.verify_width)
        return [look] if look is not None else []

    def control_cost(self, dec: Decoder) -> MeasuredCostModel:
        """The controllers' measured cost model for ``dec``'s drafting model (one per drafting
        model, timed once - at start-up, ``prepare_control`` - then refreshed by every request)."""
        drafting = dec.drafter_of("draft-model") or dec.drafter_of("layer-skip")
        model = drafting.model if drafting is not None else dec.target
        # the wrapped weights and how they run (a float target gets a fresh wrapper per decoder)
        key = (id(getattr(model, "hf_model", model)), getattr(model, "backend", None), id(dec.target.hf_model),
               dec.target.backend, dec.pads)
        cost = self._costs.get(key)
        if cost is None:
            cost = self._costs[key] = controller_cost(dec)
        return cost

    def prepare_control(self, strategies: list[Strategy]) -> None:
        """Build the decoders of ``strategies`` (plain decoding included) and time their
        controllers' cost models now (while ``/health`` says loading), not in a request."""
        if self.control is None:
            return
        for strategy in dict.fromkeys([PLAIN, *strategies]):
            if self.servable(strategy) is not None:
                continue
            cost = self.control_cost(self.decoder(strategy))
            with torch.inference_mode():
                cost.prepare()

    def unknown_start(self, default: Strategy) -> Strategy:
        """What a request far from every stored task starts on (the book's ``fallback``, with no
        general entry stored): ``default``, the server's untuned draft, where this server's measured
        cost model expects it to beat plain decoding alone at the acceptance of a route that stored
        none (``DEFAULT_ACCEPTANCE``; a confidence-aware chain at the length that pays best up to
        its cap), else plain decoding. The answer differs by precision and machine: on a 2-core CPU
        the Qwen pair's default chain ran below plain on most kinds of text with an int4 target and
        above it with a float32 one (docs/benchmarks.md)."""
        if not default.speculates or self.servable(default) is not None:
            return PLAIN
        dec = self.decoder(default)
        cost = self.control_cost(dec) if self.control is not None else controller_cost(dec)
        with torch.inference_mode():
            per_token = cost.draft_forward_s(default.layer_plan) if default.drafter != "prompt-lookup" else 0.0
            pays = pays_alone(Candidate.of(default, DEFAULT_ACCEPTANCE, per_token), cost.verify_s, cost.plain_step_s(),
                              stops_early=default.confidence_threshold > 0 and not default.tree_widths)
        return default if pays else PLAIN

    def _controlled(self, job: Job) -> bool:
        """Routed requests are controlled; an explicit choice (plain, default, a stored id), a
        request re-tuning its route and one whose strategy this server cannot run decode as chosen."""
        return self.control is not None and job.choice.route not in EXPLICIT_ROUTES and job.choice.state == "stored"

    def _draft_for(self, strategy: Strategy) -> str | None:
        return self.draft if strategy.drafter == "draft-model" else None

    def acquire(self, strategy: Strategy) -> Decoder:
        """A decoder of ``strategy`` that serves no running request (a batch-mate of the same
        strategy gets another one, built from the pool's shared weights)."""
        dec = self.decoder(strategy)
        if id(dec) in self._in_use:
            spare = self._spare.setdefault(strategy, [])
            if spare:
                dec = spare.pop()
            else:
                width = dec.verify_width if strategy.speculates or dec.standby else None
                standby = self._standby(strategy, width)
                dec = build_decoder(self.pool, self.target, strategy, self._draft_for(strategy),
                                    verify_width=width, standby=standby)
        self._in_use.add(id(dec))
        dec.target.slots = self.slots
        return dec

    def release(self, strategy: Strategy, dec: Decoder) -> None:
        self._in_use.discard(id(dec))
        if self.slots is not None:
            self.slots.give_back(dec)
        dec.step_cap = dec.step_width = None  # a batch's draft for its last request is not the next one's
        dec.apply(strategy)  # its controller may have switched it: the next request starts from its key
        if self.decoders.get(strategy) is not dec:
            spare = self._spare.setdefault(strategy, [])
            if len(spare) < self.max_batch and strategy in self.decoders:
                spare.append(dec)
        for gone in [s for s in self._spare if s not in self.decoders]:  # its primary was evicted
            del self._spare[gone]

    def batch_target(self) -> CausalLM:
        """The target wrapper batched steps run: on CPU in float32, the packed copy at the verify
        width (verify rows are then computed as a solo verify computes them); else the served one."""
        if self._batch_target is None or self._batch_target[0] != self.verify_width:
            lm = self.pool.served(self.target)
            backend = verify_packing(lm, self.pool.device, self.pool.compile)
            if backend is not None and self.verify_width > 1:
                lm = self.pool.target_for_width(self.target, backend, self.verify_width)
            if self.pool.compile and not lm.is_compiled:
                lm.compile_steps()
            self._batch_target = (self.verify_width, lm)
        return self._batch_target[1]

    def use_slots(self, context: int) -> int:
        """Under ``serve --compile`` with batching: keep every running sequence's K/V in one slot
        cache (a slot per request, and one for a re-tune decoding alone), so each batched step runs as one
        compiled forward per row bucket (``runtime.slots``) -> bytes per slot (0: not used)."""
        lm = self.batch_target()
        if not (self.pool.compile and self.max_batch > 1 and lm.is_compiled and lm.windows is None):
            return 0
        self.slots = SlotCache(lm, self.max_batch + 1, context + 2 * max(self.verify_width, 1) + 2)
        return self.slots.bytes_per_slot

    def compile_buckets(self) -> float:
        """Under slots: one batched step at every row bucket a step can reach (the step's row budget,
        else every sequence at the verify width), so each bucket's graph is built while ``/health``
        says loading -> seconds spent."""
        if self.slots is None:
            return 0.0
        started = time.perf_counter()
        lm, holder = self.batch_target(), object()
        for rows in [b for b in ROW_BUCKETS if b <= self._bucket_limit()]:
            cache = self.slots.take(holder, rows)
            if cache is None:
                break
            with torch.inference_mode():
                lm.forward_batch([BatchPart(torch.zeros(rows, dtype=torch.long, device=lm.device), cache)])
        self.slots.give_back(holder)
        return time.perf_counter() - started

    def _bucket_limit(self) -> int:
        """The widest row bucket a batched step can reach: the step's row budget, else every
        sequence at the verify width."""
        return row_bucket(self.max_batch_rows or self.max_batch * max(self.verify_width, 1))

    def _run(self) -> None:
        try:
            while self._fill():
                if self._prefilling is not None:  # a long prompt: its next chunk, then the batch's step
                    self._prefill()
                if self._batch:
                    self._step()
                if self.adapter is not None:  # what a request left for after its answer (a re-tune's check and write)
                    self.adapter.after_answer(skip=self._closing)
        except BaseException:  # nothing can go on after this: say so to everyone waiting
            self._died = True
            log.critical("the decode worker stopped; /health answers 503 from now on", exc_info=True)
            for job in [r.job for r in self._batch] + [self._solo]:
                if job is not None:
                    job.emit("error", _decode_failed())
            self._batch, self._solo = [], None
            self._refuse_waiting(ApiError(503, "this server cannot decode (its decode worker stopped)",
                                          type_="server_error", code="worker_dead"))

    def _fill(self) -> bool:
        """Admit waiting requests while the batch has room (blocking while nothing runs) -> False
        once the worker should end (the stop sentinel was seen and nothing runs). Prefills run one
        at a time: none is admitted while a long prompt's chunks are still running."""
        while len(self._batch) < self.max_batch and self._prefilling is None:
            # block for the next request only when there is nothing else to do
            idle = not self._batch and not self._stop_seen and not (self.adapter is not None and self.adapter.deferred)
            try:
                job = self.jobs.get() if idle else self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is None:
                self._stop_seen = True
                continue
            self._admit(job)
        return bool(self._batch) or self._prefilling is not None or not self._stop_seen

    def _admit(self, job: Job) -> None:
        """Start ``job``: its prefill's first chunk now (a prompt of one chunk then joins the batch
        at once; a longer one runs a chunk before each step until it joins: ``_prefill``). A
        re-tune's request decodes whole, alone."""
        if job.cancelled.is_set():
            return
        if self._closing:  # queued in the instant before a drain emptied the queue
            job.emit("error", _shutting_down())
            return
        self._solo = job
        try:
            if self.fault is not None:
                self.fault(job)
            if self.servable(job.choice.strategy) is not None:  # logged once; lossless either way
                job.choice = replace(job.choice, strategy=PLAIN, label="plain", state="unservable")
            retune = None
            if self.adapter is not None and job.choice.state != "unservable":
                retune = self.adapter.begin(job)
            if retune is not None:
                self._decode_alone(job, lambda after: self.adapter.generate_retune(job, retune, after))
                self._solo = None
                return
            strategy = job.choice.strategy
            dec = self.acquire(strategy)
            self._prefilling = Prefilling(job, strategy, dec, dec.start_steps(job.ids, job.cfg))
        except ApiError as exc:
            self._fail(job, None, exc)
            self._solo = None
            return
        except Exception:  # a bug must not kill the worker: report it to this request only
            self.failures += 1
            log.exception("decoding a request failed")  # the details go to the log, never to the client
            self._fail(job, None, _decode_failed())
            self._solo = None
            return
        self._prefill()

    def _prefill(self) -> None:
        """The prefilling request's next prompt chunk; after its last, it joins the batch. A request
        withdrawn (or stopped by a drain's grace) between chunks leaves with its decoder and slot."""
        p = self._prefilling
        assert p is not None
        job, strategy, dec = p.job, p.strategy, p.decoder
        running: Running | None = None
        try:
            try:
                if job.cancelled.is_set():
                    self.release(strategy, dec)
                    self._prefilling = self._solo = None
                    return
                if p.started and self.on_prefill_chunk is not None:
                    self.on_prefill_chunk()
                p.started = True
                try:
                    _user_errors(next, p.steps)
                    return  # more chunks: the batch steps first
                except StopIteration as done:
                    seq = done.value
            except BaseException:
                self.release(strategy, dec)
                self._prefilling = None
                raise
            self._prefilling = None
            control = None
            if self._controlled(job):
                # where the route's latest requests mostly ended (else its strategy): the request starts there
                start = self.priors.start(job.choice.route, strategy, decoder_options(strategy, dec, self.control),
                                          job.choice.distance)
                control = RequestController(strategy, dec, self.control_cost(dec), len(job.ids), self.control,
                                            self.corrections, start=start)
            running = Running(job, Member(dec, seq), strategy, control)
            self._batch.append(running)
            self._solo = None
            if self._after_round(job, seq.out):
                self._leave(running)
        except ApiError as exc:
            self._fail(job, running, exc)
        except Exception:  # a bug must not kill the worker: report it to this request only
            self.failures += 1
            log.exception("decoding a request failed")  # the details go to the log, never to the client
            self._fail(job, running, _decode_failed())
        if self._prefilling is None:
            self._solo = None  # not on a BaseException: the worker's end answers this request too

    def _step(self) -> None:
        """One round for every running request; the finished, stopped and departed ones leave."""
        batch = list(self._batch)
        self._control(batch)
        self._choose_lengths(batch)
        drafting = sum(r.member.seq.stats.draft_s for r in batch)
        drafted = [r.member.seq.stats.drafted for r in batch]
        try:
            self._sync_drafters(batch)  # timed as the requests' prefill, not the step's
            started = time.perf_counter()
            _user_errors(batch_round, self.batch_target(), [r.member for r in batch])
        except Exception as exc:  # which request's round failed is unknown: the step's requests fail
            if not isinstance(exc, ApiError):
                self.failures += 1
                log.exception("a batched decode step failed")
            for r in batch:
                self._fail(r.job, r, exc if isinstance(exc, ApiError) else _decode_failed())
            return
        drafting_s = sum(r.member.seq.stats.draft_s for r in batch) - drafting
        if len(batch) > 1:  # the target forward's time: the step's, less its drafting
            forward_s = time.perf_counter() - started - drafting_s
            self.step_cost.observe(sum(r.member.decoder.last_rows for r in batch), len(batch), forward_s)
        self._observe_drafting(batch, [r.member.seq.stats.drafted - n for r, n in zip(batch, drafted)], drafting_s)
        if self.on_step is not None:
            self.on_step(batch)
        for r in batch:
            if self._after_round(r.job, r.member.seq.out) or r.member.seq.finished:
                self._leave(r)

    def _observe_drafting(self, batch: list[Running], drafted: list[int], seconds: float) -> None:
        """The step's drafting, for the draft model's depth price (``DraftCost``): where every
        sequence that drafted ran a chain of one draft model, its depths are the longest chain."""
        drafting = [(r, n) for r, n in zip(batch, drafted) if n > 0]
        keys = {draft_key(r.member.decoder) for r, _ in drafting}
        if not drafting or len(keys) != 1 or None in keys or any(
                r.current.drafter != "draft-model" or r.current.tree_widths or r.current.dynamic_widths
                for r, _ in drafting):  # (a lookup copy drafts free, though its decoder holds a draft model)
            return
        chains = [n for _, n in drafting]
        self.draft_costs.setdefault(keys.pop(), DraftCost()).observe(max(chains), sum(chains), seconds)

    def _control(self, batch: list[Running]) -> None:
        """Each controlled request's controller, before the step's round (it may switch strategy).
        A request that the load-aware choice kept from drafting in the last step of a batch skips
        it: its decisions choose among drafts it is not running (it decides once load lets it
        draft again)."""
        alone = len(batch) == 1
        for r in batch:
            if r.control is None or (not alone and r.member.decoder.step_cap == 0):
                continue
            seq = r.member.seq
            try:
                r.control.before_round(r.member.decoder, seq.prompt + seq.out, seq.cache, seq.stats, alone=alone,
                                       batch=len(batch))
            except Exception:  # its strategy stays what it was; the request goes on, uncontrolled
                log.exception("a request's controller failed; it keeps decoding with %s", r.current.to_json())
                r.member.decoder.apply(r.current)
                r.control = None

    def _choose_lengths(self, batch: list[Running]) -> None:
        """Each speculative request's draft length and tree width this step
        (``autotune.tuning.load``): its strategy's when it decodes alone, the goodput-maximising
        ones in a batch. Either way a request whose drafting model has yet to catch up on its
        sequence drafts only where that catch-up pays back over the tokens it has left."""
        if not self.load_aware:
            for r in batch:
                r.member.decoder.step_cap = _fit_rows(r.current, self.max_batch_rows)
                r.member.decoder.step_width = None
            return
        candidates = [self._candidate(r) for r in batch]
        if len(batch) == 1:
            r = batch[0]
            r.member.decoder.step_cap = _fit_rows(r.current, self.max_batch_rows) if starts_alone(candidates[0], self.step_cost) else 0
            r.member.decoder.step_width = None
            return
        for r, shape in zip(batch, choose_shapes(candidates, self.step_cost, self.max_batch_rows)):
            r.member.decoder.step_cap, r.member.decoder.step_width = shape.length, shape.width

    def _candidate(self, r: Running) -> Candidate:
        """``r``'s options this step for the goodput choice (``autotune.tuning.load.Candidate``)."""
        s, seq = r.current, r.member.seq
        stats = seq.stats
        entry = r.job.choice.entry
        prior = self.acceptance.get(r.job.choice.route, s)  # the route's live figure, else the stored one
        if prior is None and entry is not None and r.job.choice.state == "stored":
            prior = entry.acceptance
        fixed, group = 0.0, None
        key = draft_key(r.member.decoder) if s.drafter == "draft-model" else None
        shared = self.draft_costs.get(key) if key is not None else None
        if shared is not None and shared.known:  # batch-mates drafting with its weights share each depth's forward
            per_token, fixed, group = shared.per_seq, shared.fixed, key
        else:
            per_token = stats.draft_s / stats.drafted if stats.drafted else self.draft_token_s.get(s.drafter)
            if per_token is None:
                per_token = DRAFT_TOKEN_SHARE * self.step_cost.predict(1, 1)
        catch_up = self.catch_ups.get(s.drafter) if s.speculates and not r.drafter_synced else None
        return Candidate.of(s, acceptance_estimate(prior, stats.accepted, stats.drafted), per_token,
                            start_s=catch_up.predict(len(seq.prompt) + len(seq.out)) if catch_up is not None else 0.0,
                            remaining=seq.config.max_new_tokens - len(seq.out), draft_fixed_s=fixed, draft_group=group)

    def _sync_drafters(self, batch: list[Running]) -> None:
        """Before the first step a request drafts in, its drafting model runs over the prompt
        (``Decoder.draft_prefill``, timed as prefill), not at admission: a request that a loaded
        batch never lets draft never pays for it, and the next request's prefill waits less. What it
        cost is kept by drafter kind (``CatchUpCost``: what the next request's start is priced at)."""
        for r in batch:
            if not r.drafter_synced and r.member.decoder.step_cap != 0:
                seq = r.member.seq
                before = seq.stats.prefill_s
                ran = r.member.decoder.draft_prefill(seq)  # times itself, as prefill
                r.drafter_synced = True
                if ran:  # a catch-up that ran nothing (none needed) says nothing of its price
                    self.catch_ups.setdefault(r.current.drafter, CatchUpCost()).observe(ran, seq.stats.prefill_s - before)

    def warm_up(self, strategies: list[Strategy], tokens: int = 24) -> float:
        """Decode a short dummy prompt with each servable strategy while ``/health`` says loading,
        not inside a request: the prefill's weight copies are built (a quantised model's bf16
        copies), each drafting model runs once, and under ``serve --compile`` the compiled steps of
        the first cache-size bucket are built -> seconds spent. Each decodes as a request would
        (``acquire``): with K/V slots (``use_slots``, called first) a lone request's steps run on
        its slot, a cache of the slot's size, whose graphs a decode on a cache of its own would not
        build (the first request alone compiled one)."""
        started = time.perf_counter()
        prompt = list(range(1, 9))
        for strategy in dict.fromkeys([PLAIN, *strategies]):
            if self.servable(strategy) is None:
                dec = self.acquire(strategy)
                try:
                    dec.generate(prompt, GenerationConfig(max_new_tokens=tokens))
                finally:
                    self.release(strategy, dec)
        return time.perf_counter() - started

    def profile_steps(self) -> None:
        """Time batched target forwards at a few (rows, sequences), and the draft model's depth
        forward at each batch size: the step cost's and the draft cost's start-up profiles (the real
        steps refine them)."""
        from autotune.measure.steps import batch_sizes, choose_row_ways, step_shapes, time_steps

        lm = self.batch_target()
        ways = choose_row_ways(lm, self.max_batch_rows or self.max_batch * self.verify_width)
        if ways:
            log.info("batched rows run %s", ", ".join(f"{r}: {lm.row_ways[r]}" for r in sorted(ways)))
        shapes = step_shapes(self.max_batch)
        if self.slots is not None:  # the compiled buckets' steps over K/V slots, as requests run them
            shapes = [(r, s) for r, s in shapes if r <= self._bucket_limit()]  # (a slot each: max_batch + 1 slots)
        self.step_cost = StepCost(time_steps(lm, shapes, slots=self.slots))
        if self.pool.compile:  # a compiled draft would compile each new shape: real steps price it
            return
        drafts = {draft_key(d): d.drafter_of("draft-model").model for d in self.decoders.values() if draft_key(d)}
        shapes = [(b, b) for b in batch_sizes(self.max_batch)]  # one depth: a row for each sequence
        for key, model in drafts.items():
            cost = self.draft_costs[key] = DraftCost([(seqs, t) for _, seqs, t in time_steps(model, shapes)])
            log.info("a draft depth forward costs %.1f ms + %.1f ms a sequence", cost.fixed * 1e3, cost.per_seq * 1e3)

    def _leave(self, r: Running) -> None:
        """``r`` is done (finished, stopped, or its client left): out of the batch, answered."""
        self._batch.remove(r)
        self.release(r.strategy, r.member.decoder)
        stats = r.member.seq.stats
        # one strategy decoded it all (the one it started with: its route's moved prior, maybe not its decoder's key)
        if stats.drafted and r.current.speculates and (r.control is None or not r.control.switches):
            self.draft_token_s[r.current.drafter] = stats.draft_s / stats.drafted
            self.acceptance.observe(r.job.choice.route, r.current, stats.accepted, stats.drafted)
        try:
            result = r.member.seq.result()
            if r.control is not None:
                r.job.control = r.control.summary(decode_s=result.stats.wall_s - result.stats.prefill_s)
                # a request too short to decide says nothing about its route, and ``unknown`` is every
                # unseen kind at once: what one kind ended on is no prior for the next
                if r.control.decisions and r.job.choice.route != UNKNOWN:
                    self.priors.observe(r.job.choice.route, r.control.current, r.job.choice.distance)
                if self.on_control is not None:
                    self.on_control(r.job)
            if self.adapter is not None:
                self.adapter.decoded(r.job, result)
            if not r.job.cancelled.is_set():
                self._complete(r.job, result)
            self.failures = 0
        except ApiError as exc:
            r.job.emit("error", exc)
        except Exception:
            self.failures += 1
            log.exception("finishing a request failed")
            r.job.emit("error", _decode_failed())

    def _fail(self, job: Job, running: Running | None, err: ApiError) -> None:
        if running is not None and running in self._batch:
            self._batch.remove(running)
            self.release(running.strategy, running.member.decoder)
        job.emit("error", err)

    def _after_round(self, job: Job, tokens: list[int]) -> bool:
        """After the prefill and each round: time to first token, streamed text -> True when the
        request stops here (a stop string, or its client left)."""
        if job.first_token_at is None:
            job.first_token_at = time.perf_counter()
        # text is decoded between rounds only when someone reads it then: a streaming client, or
        # stop strings that may end decoding early; otherwise once, at the end
        if job.streamed or job.stream.stops:
            self._release(job, job.stream.push(tokens))
        return job.stream.stopped or job.cancelled.is_set()

    def _decode_alone(self, job: Job, decode: Callable[[Callable[[list[int]], bool]], GenerationResult]) -> None:
        """Decode ``job`` whole, now, while the batch waits (a re-tune's tuner drives its rounds)."""
        result = _user_errors(decode, lambda tokens: self._after_round(job, tokens))
        if not job.cancelled.is_set():
            self._complete(job, result)
        self.failures = 0

    def _complete(self, job: Job, result: GenerationResult) -> None:
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


def draft_key(decoder: Decoder) -> str | None:
    """Which draft model's weights ``decoder`` drafts with (its draft-model drafter, drafting or on
    standby; None: none): sequences with the same key run each draft depth as one forward
    (``runtime.batching.draft_together`` groups them by the same weights)."""
    drafter = decoder.drafter_of("draft-model")
    if drafter is None:
        return None
    model = drafter.model
    return f"draft-model:{id(getattr(model, 'linears', model))}:{id(getattr(model, 'head', model))}"


def _fit_rows(strategy: Strategy, max_rows: int | None) -> int | None:
    """The longest draft of ``strategy`` whose verify fits ``max_rows`` rows (None: no cap needed)."""
    if max_rows is None or not strategy.speculates:
        return None
    rows = strategy_rows(strategy)
    k = strategy.draft_length
    while k > 0 and rows(k) > max_rows:
        k -= 1
    return None if k == strategy.draft_length else k


def _user_errors(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, a strategy this server cannot run (a layer plan that does not fit) as a 400."""
    try:
        return fn(*args)
    except RuntimeUserError as exc:
        raise ApiError(400, str(exc), "autotune.strategy", code="strategy_unusable") from None


def _shutting_down(message: str = "the server is shutting down; retry on another replica") -> ApiError:
    return ApiError(503, message, type_="server_error", code="shutting_down",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def _decode_failed() -> ApiError:
    return ApiError(500, "decoding failed (internal error; see the server log)", type_="server_error",
                    code="decode_failed")
