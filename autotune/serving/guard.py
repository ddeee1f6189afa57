"""The API key and the body size limit, checked before FastAPI reads or parses a request.

A plain ASGI middleware in front of the app: a request without the key gets 401 before its body
is read; a body over the limit gets 413, from its Content-Length when it declares one, or while
it is read when the header is missing or lies, so an oversized body is never buffered whole nor
parsed. ``/health`` and ``/metrics`` stay open: probes and scrapers carry no key.
"""
from __future__ import annotations

import json
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from autotune.serving.limits import Limits
from autotune.serving.protocol import ApiError

Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[dict[str, Any], Receive, Send], Awaitable[None]]
OPEN_PATHS = frozenset({"/health", "/metrics"})  # everything else (/v1/*) needs the key when one is set


class Guard:
    """``Guard(app, limits, on_refusal)``; ``on_refusal(status)`` counts what it refused."""

    def __init__(self, app: App, limits: Limits, on_refusal: Callable[[int], None] | None = None) -> None:
        self.app, self.limits, self.on_refusal = app, limits, on_refusal
        self.key = limits.api_key.encode() if limits.api_key is not None else None

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan events
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        refusal = self._unauthorised(scope["path"], headers) or self._declared_too_large(headers)
        if refusal is not None:
            await self._refuse(refusal, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before its body was whole: no one to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limits.max_body_bytes:  # no (or a lying) Content-Length
                await self._refuse(self._too_large(), send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    def _unauthorised(self, path: str, headers: dict[bytes, bytes]) -> ApiError | None:
        if self.key is None or path in OPEN_PATHS:
            return None
        scheme, _, given = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() == b"bearer" and secrets.compare_digest(given.strip(), self.key):
            return None
        return ApiError(401, "a valid API key is required: send the header 'Authorization: Bearer KEY' with the "
                             "key this server was started with (--api-key or $AUTOTUNE_API_KEY)",
                        code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def _declared_too_large(self, headers: dict[bytes, bytes]) -> ApiError | None:
        declared = headers.get(b"content-length", b"")
        return self._too_large() if declared.isdigit() and int(declared) > self.limits.max_body_bytes else None

    def _too_large(self) -> ApiError:
        return ApiError(413, f"the request body is larger than this server's limit of {self.limits.max_body_bytes} "
                             "bytes (--max-body-bytes)", code="request_too_large",
                        headers={"Connection": "close"})  # the unread rest of the body cannot be skipped

    async def _refuse(self, err: ApiError, send: Send) -> None:
        if self.on_refusal is not None:
            self.on_refusal(err.status)
        payload = json.dumps(err.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
        await send({"type": "http.response.start", "status": err.status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the app the body already read, then the client's later messages
    (a streaming response waits on them to notice a disconnect)."""
    pending = True

    async def replayed() -> Message:
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
