"""The OpenAI-compatible HTTP API (FastAPI) in front of one decode worker.

``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE streaming with ``[DONE]``),
``GET /v1/models``, ``GET /health``, ``GET /metrics``. Every response carries an ``autotune``
object next to ``usage``: the route, the strategy (stored id, "plain" or "default"), drafted,
accepted, M, tokens/s, and where its time to the first token went (``jobs.stages``). Bad input is
refused here with an OpenAI error body and never reaches the worker; an error body never carries a
path, a storage URL or an exception's name (those go to the log). ``guard.Guard`` checks the API key and the body size before any of this runs.
"""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError, TemplateSyntaxError
from starlette.exceptions import HTTPException as StarletteHTTPException

from autotune.serving.guard import Guard
from autotune.serving.limits import Limits
from autotune.serving.protocol import (
    ApiError, ChatCompletionRequest, CompletionRequest, chunk_body, completion_body, new_id, validation_error,
)
from autotune.serving.routing.book import StrategyBook
from autotune.serving.text import TextStream
from autotune.serving.jobs import Choice, Job, Outcome, stages
from runtime.decoding import GenerationConfig, check_fits
from runtime.errors import RuntimeUserError
from runtime.sampling import SamplingParams
from studies import Prompt, encode_prompt, routing_text

LOOKUP_THREADS = 2  # threads reading explicit strategy ids from the store
DEFAULT_CHAT_MAX_TOKENS = 256  # a chat request without max_tokens (OpenAI's own default is "up to the context")
log = logging.getLogger("autotune.serve")


class Server:
    """What the endpoints share: the served model, its worker, the strategy book and metrics."""

    def __init__(self, name: str, target: Any, worker: Any, book: StrategyBook, metrics: Any,
                 limits: Limits | None = None, context: int | None = None, prefill_chunk: int | None = None,
                 sizing: Any = None) -> None:
        self.name, self.target, self.worker, self.book, self.metrics = name, target, worker, book, metrics
        self.limits = limits if limits is not None else Limits()
        self.tokenizer = target.tokenizer
        # prompt + max_tokens of one request: the model's context, or less (--max-context)
        self.context = context or target.hf_model.config.max_position_embeddings
        self.sizing = sizing  # how the batch, the context and the prefix cache were sized (``serving.sizing``)
        from runtime.pipeline import eos_ids

        self.eos = eos_ids(target)
        # a longer prompt is prefilled in chunks of this many tokens, one per decode step (``prefill``)
        # (None: GenerationConfig's default)
        self.prefill_chunk = prefill_chunk
        self.lookups = ThreadPoolExecutor(LOOKUP_THREADS, thread_name_prefix="autotune-lookup")

    def prefill(self) -> dict[str, Any]:
        """How prompts are prefilled: chunks of ``chunk`` tokens, run inside the batch's decode steps
        (``in_steps``: the target's rows are reusable, so a chunk's rows ride its forward bit for bit as
        alone) or alone between them."""
        chunk = self.prefill_chunk if self.prefill_chunk is not None else GenerationConfig().prefill_chunk
        return {"chunk": chunk, "in_steps": self.worker.decoders.batch_target().rows_reusable}

    def describe_prefill(self) -> str:
        """The ready line's words for :meth:`prefill`."""
        p = self.prefill()
        return f"prompt chunks of {p['chunk']} tokens {'inside decode steps' if p['in_steps'] else 'between steps'}"

    def close(self) -> None:
        """Stop the worker (the running request stops at its next round) and flush store writes."""
        self.lookups.shutdown(wait=False, cancel_futures=True)
        self.worker.stop()
        if self.worker.adapter is not None:
            self.worker.adapter.close()

    def names(self) -> set[str]:
        return {self.name, self.target.model_id}

    def check_model(self, req: CompletionRequest | ChatCompletionRequest) -> None:
        if req.model not in self.names():
            raise ApiError(404, f"model '{req.model}' is not served here; GET /v1/models lists '{self.name}'",
                           "model", code="model_not_found")

    async def lookup(self, req: CompletionRequest | ChatCompletionRequest) -> Choice | None:
        """The choice of an explicit strategy id the book does not hold, read from the store on
        the lookup threads (a slow store delays these requests only, never tokenising); else None."""
        if not self.book.needs_lookup(req.autotune.strategy):
            return None
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.lookups, self.book.choose, "", req.autotune.strategy)

    def job(self, req: CompletionRequest | ChatCompletionRequest, prompt: Prompt, emit: Any,
            default_max: int, choice: Choice | None = None) -> tuple[Job, int]:
        """Validate against the model and choose the strategy (unless ``choice`` was looked up);
        -> (job, prompt tokens)."""
        self.check_model(req)
        ids = self.encode(prompt)
        room = self.context - len(ids)
        max_tokens = req.max_tokens if req.max_tokens is not None else min(default_max, max(room, 1))
        try:
            check_fits(len(ids), max_tokens, self.context, budget="max_tokens")  # the rule Decoder applies
        except RuntimeUserError as exc:
            param = "max_tokens" if ids else ("messages" if prompt.messages else "prompt")
            raise ApiError(400, str(exc), param, code="context_length_exceeded" if ids else "empty_prompt") from None
        if choice is None:
            choice = self.book.choose(routing_text(prompt), req.autotune.strategy)
        sampling = SamplingParams(temperature=req.temperature, top_p=req.top_p)
        seed = req.seed if req.seed is not None else secrets.randbits(31)
        chunk = {} if self.prefill_chunk is None else {"prefill_chunk": self.prefill_chunk}
        cfg = GenerationConfig(max_new_tokens=max_tokens, sampling=sampling, seed=seed, eos_token_ids=self.eos,
                               cache_prompt=req.cache_prompt, **chunk)
        return Job(ids=ids, cfg=cfg, choice=choice, stream=TextStream(self.tokenizer, list(req.stop or [])), emit=emit,
                   streamed=req.stream, text=routing_text(prompt)), len(ids)

    def encode(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids; a chat template that refuses the messages (``raise_exception``,
        e.g. roles that do not alternate) is the client's 400. A template that does not compile is
        the server's fault: left to the 500 handler."""
        try:
            return encode_prompt(prompt, self.tokenizer)
        except TemplateSyntaxError:
            raise
        except TemplateError as exc:
            raise ApiError(400, f"the model's chat template refused these messages: {exc.message or 'no reason given'}",
                           "messages", code="invalid_messages") from None


def autotune_fields(job: Job, outcome: Outcome, token_ids: bool) -> dict[str, Any]:
    """The response's ``autotune`` object (with the completion's token ids when asked for)."""
    s, choice = outcome.stats, job.choice
    out = {
        "route": choice.route, "distance": choice.distance, "strategy": choice.label, "state": choice.state,
        "drafted": s.drafted, "accepted": s.accepted, "draft_rounds": s.draft_rounds,
        "accepted_per_position": list(s.position_accepted), "mean_accepted": s.mean_accepted,
        "tokens_per_s": s.tokens_per_s, "ttft_s": outcome.ttft_s, "latency_s": outcome.latency_s,
        "prefix_tokens": s.prefix_rows, "stages": stages(job),
    }
    if job.control is not None:  # routed: what its controller did (prior, final strategy, switches, scoring time)
        out["control"] = job.control
    if job.tuning is not None:  # a re-tune's request: its tuning time, trials and points swept
        out["tuning"] = job.tuning
    cluster = job.adapt[2] if job.adapt is not None else None
    if cluster is not None:  # ``unknown`` under --adaptive: the pending cluster it joined (a new route in the making)
        out["cluster"] = cluster
    if token_ids:
        out["token_ids"] = outcome.tokens
    return out


def usage(prompt_tokens: int, outcome: Outcome) -> dict[str, Any]:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens``: the prompt tokens whose rows came
    from the prefix cache."""
    n = len(outcome.tokens)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": outcome.stats.prefix_rows}}


def _error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def create_app(server: Server, lifespan: Any = None) -> FastAPI:
    app = FastAPI(title="autotune serve", version="1", lifespan=lifespan)
    app.add_middleware(Guard, limits=server.limits,
                       on_refusal=lambda status: server.metrics.errors.labels(str(status)).inc())
    _add_error_handlers(app, server)
    _add_routes(app, server)
    return app


def _add_error_handlers(app: FastAPI, server: Server) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        server.metrics.errors.labels(str(exc.status)).inc()
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return await _api_error(request, validation_error(list(exc.errors())))

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:  # never a bare 500 page
        # the message is fixed: an exception's text can hold paths, storage URLs or other keys' rows
        log.error("internal error serving %s %s", request.method, request.url.path, exc_info=exc)
        err = ApiError(500, "internal error; see the server log", type_="server_error", code="internal_error")
        return await _api_error(request, err)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = ApiError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None)
        return await _api_error(request, err)


def _add_routes(app: FastAPI, server: Server) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        """200 when this server can serve; 503 with the reason in ``status`` while it drains
        (SIGTERM), when its decode worker died, or after ``worker_config.FAILING_AFTER`` internal decode
        failures in a row (``failing``; a success clears it). ``launcher`` answers "loading"."""
        condition = server.worker.condition()
        out: dict[str, Any] = {"status": condition or "ok", "model": server.name, "queue_depth": server.worker.depth,
                               "running": server.worker.running}
        if condition == "failing":
            out["consecutive_failures"] = server.worker.failures
        out["tasks"] = server.book.tasks()  # the stored tasks requests are routed to
        # each route's live acceptance per strategy: what the load-aware draft lengths start from
        out["acceptance"] = server.worker.figures.acceptance.describe()
        out["context"] = server.context
        out["prefill"] = server.prefill()
        prefix = server.worker.decoders.prefix
        if prefix is not None:  # the prefix cache's budget in use
            st = prefix.stats
            out["prefix_cache"] = {"budget_bytes": st.budget_bytes, "used_bytes": st.used_bytes, "blocks": st.blocks,
                                   "tokens_reused": st.tokens_reused, "hit_rate": st.hit_rate}
        if server.worker.adapter is not None:  # per-route drift figures and re-tunes (serve --adaptive)
            out["routes"] = server.worker.adapter.describe()
        return JSONResponse(out, status_code=503 if condition else 200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": server.name, "object": "model", "created": 0,
                                            "owned_by": "autotune", "root": server.target.model_id}]}

    @app.get("/metrics")
    async def metrics() -> Response:
        server.metrics.queue_depth.set(server.worker.depth)
        server.metrics.decoders.set(len(server.worker.decoders))  # what the worker holds
        server.metrics.verify_widths.set(len(server.worker.decoders.widths))
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, Any]:
        """Keep no K/V rows of the requests served so far (vLLM's endpoint of this name): the prefix
        cache is emptied and each draft model forgets its kept rows before its next request; running
        requests keep their own. A load test resets between passes, so no pass finds its prompts cached
        by an earlier one."""
        freed = server.worker.decoders.reset_rows()
        return {"status": "ok", "prefix_cache": server.worker.decoders.prefix is not None, "freed_bytes": freed}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        prompt = Prompt(id="request", text=req.prompt)
        return await _serve(server, request, req, prompt, "text_completion", "text_completion", default_max=16)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request) -> Any:
        prompt = Prompt(id="request", messages=tuple((m.role, m.content) for m in req.messages))
        return await _serve(server, request, req, prompt, "chat.completion", "chat.completion.chunk",
                            default_max=DEFAULT_CHAT_MAX_TOKENS)


class ClientGone(Exception):
    """The client closed its connection while its request waited or decoded."""


class Events:
    """One request's events from the worker, none awaited past the request's deadline
    (``--request-timeout``, counted from its arrival: waiting, tokenising and decoding), nor past
    its client's departure once ``watch`` is given the ASGI channel."""

    def __init__(self, server: Server) -> None:
        self.server, self.loop = server, asyncio.get_running_loop()
        self.deadline = time.monotonic() + server.limits.request_timeout_s
        self.queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.gone: asyncio.Future[None] | None = None

    def watch(self, receive: Any) -> None:
        """Watch the ASGI channel for the client's departure (call ``close`` when answered)."""
        self.gone = asyncio.ensure_future(_disconnect(receive))

    def emit(self, event: str, payload: Any) -> None:  # called on the worker thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (event, payload))

    async def next(self, job: Job) -> tuple[str, Any]:
        """The next event; ``ClientGone`` once the client left, or 504 past the deadline: the job
        then leaves the queue at once, or, when running, stops at its next round."""
        if not self.queue.empty():
            return self.queue.get_nowait()
        get = asyncio.ensure_future(self.queue.get())
        try:
            waiters = {get} if self.gone is None else {get, self.gone}
            await asyncio.wait(waiters, timeout=max(self.deadline - time.monotonic(), 0.0),
                               return_when=asyncio.FIRST_COMPLETED)
            if get.done():
                return get.result()
        finally:
            get.cancel()  # an event it took stays in the queue (asyncio.Queue.get's own rule)
        self.server.worker.withdraw(job)
        if self.gone is not None and self.gone.done():
            self.server.metrics.cancelled.labels("client_disconnected").inc()
            raise ClientGone
        self.server.metrics.cancelled.labels("timeout").inc()
        limit = self.server.limits.request_timeout_s
        raise ApiError(504, f"the request took longer than this server's limit of {limit:g} s (--request-timeout) "
                            "waiting and decoding; ask for fewer tokens or retry later",
                       type_="server_error", code="request_timeout")

    def close(self) -> None:
        if self.gone is not None:
            self.gone.cancel()


async def _disconnect(receive: Any) -> None:
    """Returns when the client has closed its connection (the request's body is read by then:
    ``guard._replay`` forwards the client's later messages)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _serve(server: Server, request: Request, req: Any, prompt: Prompt, kind: str, chunk_kind: str,
                 default_max: int) -> Any:
    server.worker.check_room()  # a full queue answers 503 before any tokenising or store lookup
    events = Events(server)
    server.check_model(req)
    choice = await server.lookup(req)  # an explicit id's store read, apart from tokenising
    job, n_prompt = await asyncio.to_thread(server.job, req, prompt, events.emit, default_max, choice)
    server.worker.submit(job)  # 503 when the queue filled meanwhile
    server.metrics.queue_depth.set(server.worker.depth)
    rid = new_id("chatcmpl" if kind == "chat.completion" else "cmpl")
    if req.stream:
        sse = _sse(server, job, events, rid, chunk_kind, n_prompt, req.autotune.return_token_ids)
        return StreamingResponse(sse, media_type="text/event-stream")  # it notices a departure and closes _sse
    events.watch(request.receive)
    try:
        while True:
            event, payload = await events.next(job)
            if event == "error":
                raise payload
            if event == "done":
                outcome: Outcome = payload
                return completion_body(kind, rid, server.name, outcome.text, outcome.finish_reason,
                                       usage(n_prompt, outcome),
                                       autotune_fields(job, outcome, req.autotune.return_token_ids))
    except ClientGone:  # its job is withdrawn; no one reads this answer (nginx's "client closed request")
        return Response(status_code=499)
    except asyncio.CancelledError:  # the server is stopping: stop decoding at the next round
        server.worker.withdraw(job)
        raise
    finally:
        events.close()


async def _sse(
    server: Server, job: Job, events: Events, rid: str, kind: str, n_prompt: int, token_ids: bool
) -> AsyncIterator[str]:
    model = server.name
    first, ended = True, False
    try:
        while True:
            try:
                event, payload = await events.next(job)
            except ApiError as exc:  # past the deadline: the headers are out, so the stream says it
                server.metrics.errors.labels(str(exc.status)).inc()
                event, payload = "error", exc
            if event == "delta":
                yield _data(chunk_body(kind, rid, model, payload, None, first))
                first = False
            elif event == "error":
                yield _data(payload.body())
                break
            else:
                last = chunk_body(kind, rid, model, None, payload.finish_reason, first)
                last["usage"] = usage(n_prompt, payload)
                last["autotune"] = autotune_fields(job, payload, token_ids)
                yield _data(last)
                break
        ended = True
        yield "data: [DONE]\n\n"
    finally:  # a client that disconnected mid-stream lands here (the generator is closed)
        if not ended:
            server.metrics.cancelled.labels("client_disconnected").inc()
        server.worker.withdraw(job)


def _data(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"
