"""Start-up and shutdown of ``autotune serve``: load, fit the router, run uvicorn, drain.

Start-up errors (unknown model, bad storage URL, port in use) are raised as user errors before
the server listens, so the CLI prints one line and exits 2. SIGTERM / Ctrl-C: uvicorn stops
accepting, the worker cancels what is queued and stops the running request at its next round,
and the process exits 0.
"""
from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from autotune.errors import CliError
from autotune.serving.limits import Limits

REFRESH_S = 10.0  # how often the server checks the store for new or changed strategies


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

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise CliError(f"--port must be in 0..65535, got {self.port}")
        if self.max_queue < 1:
            raise CliError(f"--max-queue must be at least 1, got {self.max_queue}")
        if self.route_distance is not None and not 0.0 <= self.route_distance <= 1.0:
            raise CliError(f"--route-distance must be in [0, 1] (cosine distance), got {self.route_distance}")


def check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise CliError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; pass another --port") from None


def build_server(cfg: ServeConfig, storage: Any, pool: Any = None) -> Any:
    """Load the models (into ``pool`` when given) and the strategy store's routes -> a ready
    ``Server`` (worker not started)."""
    from autotune.serving.app import Server
    from autotune.serving.metrics import ServingMetrics
    from autotune.serving.routing.book import StrategyBook
    from autotune.serving.worker import DecodeWorker
    from runtime.loading import check_vocab_compatible
    from runtime.pipeline import ModelPool

    pool = pool if pool is not None else ModelPool(device=cfg.device, compile=cfg.compile)
    target = pool.get(cfg.model, cfg.dtype)
    if cfg.draft:
        check_vocab_compatible(target, pool.get(cfg.draft, "float32"))
    metrics = ServingMetrics()
    book = StrategyBook(storage, target, cfg.draft, cfg.device, metrics, cfg.route_distance)
    book.refresh()
    worker = DecodeWorker(pool, target, cfg.draft, cfg.max_queue, on_done=lambda job, out: metrics.observe(
        job.choice.route, out.stats, out.finish_reason, out.latency_s, out.ttft_s, job.choice.distance))
    worker.share_width(book.strategies())
    if cfg.adaptive is not None:
        from autotune.serving.adaptive.adaptive import Adapter

        worker.adapter = Adapter(cfg.adaptive, pool, target, cfg.draft, cfg.device, storage, book, metrics, worker)
        worker.verify_width = max(worker.verify_width, worker.adapter.width)  # one packed target for all
    for strategy in book.strategies():  # build (and load the draft for) every routed strategy now
        worker.decoder(strategy)
    return Server(cfg.model, target, worker, book, metrics, cfg.limits)


def make_app(server: Any, refresh_s: float) -> Any:
    from autotune.serving.app import create_app

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        server.worker.start()
        refresher = asyncio.create_task(_refresh_loop(server, refresh_s))
        try:
            yield
        finally:
            refresher.cancel()
            await asyncio.to_thread(server.worker.stop)

    return create_app(server, lifespan)


async def _refresh_loop(server: Any, every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        try:
            await asyncio.to_thread(server.book.refresh_if_changed)
        except Exception:  # an unreachable store keeps the routes we have; the next poll retries
            server.metrics.errors.labels("store_refresh").inc()


def serve(cfg: ServeConfig) -> int:
    import uvicorn

    from autotune.store.storage import open_storage

    check_port_free(cfg.host, cfg.port)
    with open_storage(cfg.storage) as storage:
        server = build_server(cfg, storage)
        app = make_app(server, cfg.refresh_s)
        config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning", timeout_graceful_shutdown=30)
        print(f"autotune serve: {cfg.model} on http://{cfg.host}:{cfg.port} (routes: "
              f"{', '.join(server.book.describe()) or 'none stored: every request decodes plainly'})", flush=True)
        _run_uvicorn(config)
    return 0


def _run_uvicorn(config: Any) -> None:
    import signal

    import uvicorn

    class Drained(uvicorn.Server):
        """uvicorn re-raises a captured SIGTERM after its graceful shutdown, so the process would
        die by the signal; a supervisor's stop (SIGTERM) is a normal exit here: status 0."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            if sig == signal.SIGTERM:
                self._captured_signals = [s for s in self._captured_signals if s != signal.SIGTERM]

    Drained(config).run()
