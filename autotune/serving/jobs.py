"""What the decode worker passes around: a request's job and choice, its outcome, and the states a
request goes through on the decode thread (prefilling, running); the API errors the worker answers."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import torch

from autotune.serving.protocol import ApiError
from autotune.serving.text import TextStream
from autotune.tuning.controller import RequestController
from runtime.batching import Member
from runtime.decoding import Decoder, GenerationConfig, Sequence
from runtime.errors import RuntimeUserError
from runtime.layout import PromptChunk
from runtime.stats import DecodeStats
from search_spaces.strategy import Strategy

EXPLICIT_ROUTES = ("plain", "default", "id")  # a client's explicit choice: decoded as asked, never switched
RETRY_AFTER_S = 1  # what a 503 for a full queue, or from a draining server, suggests
HOLD_S = 2.0  # longest a finished request's answer waits for the store write its decode started
CHECK_HOLD_S = 60.0  # ... and, before that, for the result's check on the decode thread


@dataclass(frozen=True)
class Choice:
    """Which strategy a request decodes with, and why (the response's ``autotune`` object)."""

    route: str  # a task name, "unknown", or the override ("plain", "default", "id")
    strategy: Strategy
    label: str  # stored strategy id, "plain" or "default" ("tuning" while the route re-tunes)
    distance: float | None = None  # to the route's centroid (auto routing only)
    entry: Any = None  # the routed store entry (``router.RouteEntry``), when routed to one
    # "tuning" while the route re-tunes on live traffic (``adaptive``); "unservable" when this
    # server cannot run the stored strategy (``DecoderCache.servable``): it decodes plainly
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
    # where its time to the first token went (``stages``): the decode thread took it, its prompt's
    # first chunk was ready to run (routing by the adaptive layer and its decoder done), its last ran
    admitted_at: float | None = None
    prefill_at: float | None = None
    prefilled_at: float | None = None
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


def stages(job: Job) -> dict[str, float]:
    """Where ``job``'s time to its first token went, in seconds (the stages it reached): ``queue_s``
    (accepted -> the decode thread took it), ``admit_s`` (-> its prompt's first chunk ready: the
    adaptive layer's routing, its decoder), ``prefill_s`` (-> its last chunk ran, steps it rode in
    included), ``start_s`` (-> its first token: its controller's start). A re-tune's request, decoded
    whole by its tuner, has ``queue_s`` and ``decode_to_first_s``."""
    marks = [("queue_s", job.accepted_at, job.admitted_at), ("admit_s", job.admitted_at, job.prefill_at),
             ("prefill_s", job.prefill_at, job.prefilled_at), ("start_s", job.prefilled_at, job.first_token_at)]
    out = {name: round(end - begin, 6) for name, begin, end in marks if begin is not None and end is not None}
    if job.prefill_at is None and job.admitted_at is not None and job.first_token_at is not None:
        out["decode_to_first_s"] = round(job.first_token_at - job.admitted_at, 6)
    return out


def live_keys(job: Job) -> list[str]:
    """The keys ``job``'s live acceptance is kept under (``CostFigures.acceptance``): its route, and
    for an ``unknown`` request in a pending cluster (``serve --adaptive``) that cluster's
    (``unknown#<id>``), so the next request of its kind starts from what its kind measured."""
    cluster = job.adapt[2] if job.adapt is not None else None
    return [job.choice.route] + ([cluster_key(cluster)] if cluster is not None else [])


def cluster_key(cluster: int) -> str:
    """The live-acceptance key of the pending cluster ``cluster`` of unknown traffic."""
    return f"unknown#{cluster}"


@dataclass
class Running:
    """A request in the running batch."""

    job: Job
    member: Member
    strategy: Strategy  # the one it started with (its decoder's key)
    control: RequestController | None = None  # drives its strategy between rounds (routed requests)
    drafter_synced: bool = False  # its drafting model has run over the prompt (``DecodeLoop.sync_drafters``)

    @property
    def current(self) -> Strategy:
        """The strategy its next round decodes with."""
        return self.control.current if self.control is not None else self.strategy


@dataclass
class Prefilling:
    """A request whose prompt is being prefilled (``Decoder.start_steps``), a chunk at a time: in
    the batch's step where its rows can ride there, else alone between steps; it joins the batch
    after its last chunk."""

    job: Job
    strategy: Strategy
    decoder: Decoder
    steps: Generator[PromptChunk, tuple[torch.Tensor, float] | None, Sequence]
    chunk: PromptChunk | None = None  # the chunk it runs next
    started: bool = False  # a chunk of it ran


def user_errors(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, a strategy this server cannot run (a layer plan that does not fit) as a 400."""
    try:
        return fn(*args)
    except RuntimeUserError as exc:
        raise ApiError(400, str(exc), "autotune.strategy", code="strategy_unusable") from None


def shutting_down(message: str = "the server is shutting down; retry on another replica") -> ApiError:
    return ApiError(503, message, type_="server_error", code="shutting_down",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def decode_failed() -> ApiError:
    return ApiError(500, "decoding failed (internal error; see the server log)", type_="server_error",
                    code="decode_failed")


def worker_dead(message: str = "this server cannot decode (its decode worker stopped)") -> ApiError:
    return ApiError(503, message, type_="server_error", code="worker_dead")
