"""The ASGI app ``autotune serve`` runs: it listens while the models load, then serves; SIGTERM drains.

``Launcher(load, refresh_s, grace_s)`` answers every request 503 while ``load()`` builds the
server on a thread (``/health``: ``{"status": "loading"}``; the API: an OpenAI error body with
``Retry-After``), so a probe tells "loading" from "down", as llama.cpp's server does. Once loaded,
the decode worker and the store refresher start and every request goes to the server's FastAPI
app (``app.create_app``). A load that fails is kept in ``error`` and ``on_failure`` is called (the
CLI then stops uvicorn and reports it in one line, exit 2).

``drain()`` is what SIGTERM calls (``server.serve``): the worker answers its waiting requests 503
with ``Retry-After`` at once and lets the running one finish within ``grace_s``; uvicorn stops
accepting meanwhile and waits for the open responses; the lifespan's end stops the worker.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from autotune.serving.protocol import ApiError
from autotune.serving.jobs import RETRY_AFTER_S

Message = dict[str, Any]
log = logging.getLogger("autotune.serve")


class Launcher:
    def __init__(self, load: Callable[[], Any], refresh_s: float, grace_s: float,
                 on_ready: Callable[[Any], None] | None = None) -> None:
        self.load, self.refresh_s, self.grace_s, self.on_ready = load, refresh_s, grace_s, on_ready
        self.server: Any = None
        self.app: Any = None
        self.error: BaseException | None = None
        self.on_failure: Callable[[], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._refresher: asyncio.Task | None = None
        self._draining = False

    async def __call__(self, scope: Message, receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif self.app is not None:
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            await _not_ready(scope["path"], "failed" if self.error is not None else "loading", send)

    def drain(self) -> None:
        """Stop serving, letting the running request finish within the grace period. Safe in a
        signal handler: the work runs on a thread of its own (the handler may have interrupted a
        holder of the worker's queue lock)."""
        self._draining = True
        server = self.server
        if server is not None:
            threading.Thread(target=server.worker.drain, args=(self.grace_s,), name="autotune-drain",
                             daemon=True).start()

    async def _lifespan(self, receive: Callable[[], Awaitable[Message]],
                        send: Callable[[Message], Awaitable[None]]) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._loop = asyncio.get_running_loop()
                threading.Thread(target=self._load, name="autotune-load", daemon=True).start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self._shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _load(self) -> None:
        """On the loading thread: build the server, then start it on the event loop."""
        assert self._loop is not None
        try:
            server = self.load()
        except BaseException as exc:  # reported by the CLI once uvicorn stopped
            if self._draining:  # stopped while loading (the store may be closed under it): not an error
                return
            self.error = exc
            if self.on_failure is not None:
                self._loop.call_soon_threadsafe(self.on_failure)
            return
        self._loop.call_soon_threadsafe(self._ready, server)

    def _ready(self, server: Any) -> None:
        from autotune.serving.app import create_app

        if self._draining:  # stopped while loading: nothing to serve
            return
        server.worker.start()
        self._refresher = asyncio.get_running_loop().create_task(refresh_loop(server, self.refresh_s))
        self.server, self.app = server, create_app(server)
        if self.on_ready is not None:
            self.on_ready(server)

    async def _shutdown(self) -> None:
        self._draining = True
        if self._refresher is not None:
            self._refresher.cancel()
        if self.server is not None:
            await asyncio.to_thread(self.server.close)


async def _not_ready(path: str, status: str, send: Callable[[Message], Awaitable[None]]) -> None:
    if path == "/health":
        body = {"status": status}
    else:
        body = ApiError(503, "the server is starting: its models are loading; retry shortly" if status == "loading"
                        else "the server failed to start", type_="server_error", code=status).body()
    payload = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
               (b"retry-after", str(RETRY_AFTER_S).encode())]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


async def refresh_loop(server: Any, every_s: float) -> None:
    """Check the store for new or changed strategies every ``every_s`` seconds."""
    while True:
        await asyncio.sleep(every_s)
        try:
            await asyncio.to_thread(server.book.refresh_if_changed)
        except Exception:  # an unreachable store keeps the routes we have; the next poll retries
            server.metrics.errors.labels("store_refresh").inc()
