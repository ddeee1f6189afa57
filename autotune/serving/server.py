"""Start-up and shutdown of ``autotune serve``: listen, load, fit the router, serve, drain.

Start-up errors that need no model (a bad flag, a bad storage URL, a port in use, an unknown model
name) are raised as user errors before the server listens, so the CLI prints one line and exits 2.
Then it listens at once and loads the models on a thread (``/health`` answers 503 "loading"
meanwhile; a load that fails is reported the same way, one line, exit 2). SIGTERM / Ctrl-C drains
(``launcher``): uvicorn stops accepting, the waiting requests get 503 with ``Retry-After`` at once,
the running one finishes within ``--grace`` seconds (or is stopped then, 503), and the process exits 0.
"""
from __future__ import annotations

import asyncio
import logging
import contextlib
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from autotune.errors import SettingError
from autotune.serving.limits import Limits
from autotune.serving.sizing import MAX_BATCH, kv_bytes_per_slot, size
from autotune.serving.worker_config import Hooks, WorkerConfig
from runtime.machine import available_memory

log = logging.getLogger("autotune.serve")
REFRESH_S = 10.0  # how often the server checks the store for new or changed strategies
GRACE_S = 20.0  # SIGTERM: how long the running request may take to finish (under Kubernetes' 30 s)
BACKSTOP_S = 2.0  # uvicorn's own limit is the grace plus this: it cancels what is still open then


# a server's prompt chunk by device where it is not GenerationConfig's 512 (--prefill-chunk sets it): on
# the CPU a step that carries a chunk runs at ~25 ms a prompt row, so 512 rows would hold every running
# request ~12 s; 64 hold them ~1.9 s, and the prompt's own prefill took no longer (the 1.5B at gguf,
# 4 running requests, a 726-token prompt: 22.7 s in 64-row chunks, 24.3 s in 512; docs/log/23)
PREFILL_CHUNK = {"cpu": 64}


@dataclass(frozen=True)
class ServeConfig:
    model: str
    draft: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    compile: bool = False  # compiled decode steps (runtime.compiled)
    storage: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    max_queue: int = 64
    route_distance: float | None = None  # None: the router's measured default
    refresh_s: float = REFRESH_S
    adaptive: Any = None  # ``adaptive.AdaptSettings``: drift detection and re-tuning on live traffic
    limits: Limits = field(default_factory=Limits)  # API key, body size, request deadline
    grace_s: float = GRACE_S  # SIGTERM: the running requests' time to finish
    max_batch: int | None = None  # requests decoded side by side; None: MAX_BATCH, or what fits --max-context
    max_context: int | None = None  # prompt + max_tokens per request; None: what fits (``sizing.size``)
    prefix_cache_gib: float | None = None  # the prefix cache's budget; 0: none; None: the default (``sizing``)
    max_batch_rows: int | None = None  # target rows one decode step verifies at most; None: no limit
    prefill_chunk: int | None = None  # prompt tokens per chunk, one chunk a step; None: PREFILL_CHUNK, else GenerationConfig's
    request_control: bool = True  # routed requests switch strategy inside the request (``autotune.tuning.controller``)

    def __post_init__(self) -> None:
        if not 0 <= self.grace_s < float("inf"):
            raise SettingError(f"--grace must be a number of seconds >= 0, got {self.grace_s}")
        if not 0 <= self.port <= 65535:
            raise SettingError(f"--port must be in 0..65535, got {self.port}")
        if self.max_queue < 1:
            raise SettingError(f"--max-queue must be at least 1, got {self.max_queue}")
        if self.max_batch is not None and self.max_batch < 1:
            raise SettingError(f"--max-batch must be at least 1, got {self.max_batch}")
        if self.max_batch_rows is not None and self.max_batch_rows < (self.max_batch or 1):
            raise SettingError(f"--max-batch-rows must be at least --max-batch ({self.max_batch or 1}): every "
                               f"request needs a row a step; got {self.max_batch_rows}")
        if self.prefill_chunk is not None:  # the rule every request's GenerationConfig applies, at start-up
            from runtime.decoding import GenerationConfig
            from runtime.errors import RuntimeUserError

            try:
                GenerationConfig(prefill_chunk=self.prefill_chunk)
            except RuntimeUserError as exc:
                raise SettingError(f"--prefill-chunk: {exc}") from None
        if self.prefix_cache_gib is not None and not 0 <= self.prefix_cache_gib < float("inf"):
            raise SettingError(f"--prefix-cache-gib must be a number of GiB >= 0 (0: no prefix cache), got "
                               f"{self.prefix_cache_gib}")
        if self.max_context is not None and self.max_context < 2:
            raise SettingError(f"--max-context must be at least 2 tokens, got {self.max_context}")
        if self.route_distance is not None and not 0.0 <= self.route_distance <= 1.0:
            raise SettingError(f"--route-distance must be in [0, 1] (cosine distance), got {self.route_distance}")


def check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise SettingError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; pass another --port") \
                from None


def build_server(cfg: ServeConfig, storage: Any, pool: Any = None, hooks: Hooks = Hooks(),
                 adjust: Callable[[WorkerConfig], WorkerConfig] | None = None) -> Any:
    """Load the models (into ``pool`` when given) and the strategy store's routes -> a ready
    ``Server`` (worker not started). ``hooks`` are called beside the metrics' own; ``adjust``
    changes the worker's config built from ``cfg`` (tests, tools)."""
    from autotune.serving.app import Server
    from autotune.serving.metrics import ServingMetrics
    from autotune.serving.routing.book import StrategyBook
    from autotune.serving.startup import start_up
    from autotune.serving.worker import DecodeWorker
    from runtime.loading import check_vocab_compatible
    from runtime.pipeline import ModelPool, default_draft

    pool = pool if pool is not None else ModelPool(device=cfg.device, compile=cfg.compile)
    target = pool.get(cfg.model, cfg.dtype)
    if cfg.draft:
        check_vocab_compatible(target, default_draft(pool, cfg.draft))
    metrics = ServingMetrics()
    book = StrategyBook(storage, target, cfg.draft, cfg.device, metrics, cfg.route_distance)
    book.refresh()
    element = target.hf_model.lm_head.weight.element_size()  # the caches' dtype is the model's (CausalLM.new_cache)
    sizing = size(cfg.max_batch, cfg.max_context, 0.0 if cfg.compile else cfg.prefix_cache_gib,
                  target.hf_model.config.max_position_embeddings,
                  kv_bytes_per_slot(target.hf_model.config, 1, element), available_memory())
    config = WorkerConfig(max_queue=cfg.max_queue, max_batch=sizing.max_batch, max_batch_rows=cfg.max_batch_rows,
                          prefix_cache_bytes=sizing.prefix_bytes, **({} if cfg.request_control else {"control": None}))
    adapt = None
    if cfg.adaptive is not None:  # drift detection and re-tuning, on what it may use of the worker
        from autotune.serving.adaptive.adaptive import Adapter

        adapt = partial(Adapter, cfg.adaptive, pool, target, cfg.draft, cfg.device, storage, book, metrics)

    worker = DecodeWorker(pool, target, cfg.draft, adjust(config) if adjust is not None else config,
                          _metric_hooks(metrics, hooks), adapt)
    # every routed strategy's decoder, the controllers' cost models, then first decodes (the prefill's
    # bf16 weight copies; compiled steps under --compile) while /health says loading
    started = start_up(worker, book.strategies(), book.default, sizing.context)
    book.use_fallback(started.fallback)  # plain, or the default draft where it pays here
    if worker.decoders.prefix is not None:
        metrics.watch_prefix_cache(worker.decoders.prefix)
    if cfg.compile:  # compiled steps keep their K/V in static slots
        sizing = replace(sizing, prefix_off="not under --compile")
    chunk = cfg.prefill_chunk if cfg.prefill_chunk is not None else PREFILL_CHUNK.get(cfg.device)
    return Server(cfg.model, target, worker, book, metrics, cfg.limits, context=sizing.context,
                  prefill_chunk=chunk, sizing=sizing)


def _metric_hooks(metrics: Any, extra: Hooks) -> Hooks:
    """The metrics' hooks, each followed by ``extra``'s where it has one."""
    def done(job: Any, out: Any) -> None:
        metrics.observe(job.choice.route, out.stats, out.finish_reason, out.latency_s, out.ttft_s, job.choice.distance)

    return Hooks(on_done=_both(done, extra.on_done), on_step=_both(metrics.observe_step, extra.on_step),
                 on_control=_both(metrics.observe_control, extra.on_control),
                 on_prefill_chunk=_both(metrics.observe_prefill_chunk, extra.on_prefill_chunk), fault=extra.fault)


def _both(first: Callable[..., Any], then: Callable[..., Any] | None) -> Callable[..., Any]:
    if then is None:
        return first

    def call(*args: Any) -> None:
        first(*args)
        then(*args)

    return call


def make_app(server: Any, refresh_s: float) -> Any:
    """The FastAPI app of an already loaded ``server`` (what tests run in a thread)."""
    from autotune.serving.app import create_app
    from autotune.serving.launcher import refresh_loop

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        server.worker.start()
        refresher = asyncio.create_task(refresh_loop(server, refresh_s))
        try:
            yield
        finally:
            refresher.cancel()
            await asyncio.to_thread(server.close)

    return create_app(server, lifespan)


def serve(cfg: ServeConfig) -> int:
    import uvicorn

    from autotune.serving.launcher import Launcher
    from autotune.store.storage import open_storage
    from runtime.models import resolve_model

    check_port_free(cfg.host, cfg.port)
    for name in (cfg.model, cfg.draft):
        if name:
            resolve_model(name)  # an unknown model name is one line before anything loads
    with open_storage(cfg.storage) as storage:
        launcher = Launcher(lambda: build_server(cfg, storage), cfg.refresh_s, cfg.grace_s,
                            on_ready=lambda server: _announce(server, str(cfg.dtype)))
        config = uvicorn.Config(launcher, host=cfg.host, port=cfg.port, log_level="warning",
                                timeout_graceful_shutdown=cfg.grace_s + BACKSTOP_S)  # type: ignore[arg-type]
        print(f"autotune serve: loading {cfg.model}; listening on http://{cfg.host}:{cfg.port} "
              "(/health is 503 until loaded)", flush=True)
        _run_uvicorn(config, launcher)
        if launcher.error is not None:
            raise launcher.error
    return 0


def _announce(server: Any, asked: str) -> None:
    from runtime.auto_precision import explain

    sized = f", {server.sizing.describe()}" if server.sizing is not None else ""
    print(f"autotune serve: {server.name} ready at {explain(server.target.precision, asked)}{sized}, "
          f"{server.describe_prefill()} "
          f"(routes: {', '.join(server.book.describe())})", flush=True)


def _run_uvicorn(config: Any, launcher: Any) -> None:
    import signal

    import uvicorn

    class Drained(uvicorn.Server):
        """SIGTERM or Ctrl-C drains (``Launcher.drain``) while uvicorn stops accepting. uvicorn
        re-raises a captured SIGTERM after its graceful shutdown, so the process would die by the
        signal; a supervisor's stop (SIGTERM) is a normal exit here: status 0."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            launcher.drain()
            if sig == signal.SIGTERM:
                self._captured_signals = [s for s in self._captured_signals if s != signal.SIGTERM]

    uv = Drained(config)
    launcher.on_failure = lambda: setattr(uv, "should_exit", True)
    uv.run()
