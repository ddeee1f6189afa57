"""A plain OpenAI chat-completions client for servers that speak no ``autotune`` extension (a peer
such as llama-server): what ``loadtest`` needs of a response, measured on the client's side.

Each request is streamed (``stream: true`` with ``stream_options.include_usage``), greedy
(temperature 0), with no ``autotune`` object: the time to the first content chunk is its TTFT as the
client saw it, and ``usage.completion_tokens`` of the final chunk its token count.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from autotune.errors import RemoteError
from autotune.measure.replay import ReplaySettings, _error_message, _httpx
from studies.stream import StreamRequest


@dataclass(frozen=True)
class PlainRecord:
    """One response: its completion tokens and time to the first token (from the request's sending)."""

    completion_tokens: int
    ttft_s: float
    prompt_tokens: int | None = None  # the final chunk's usage.prompt_tokens, where the server reports it


def request_body(model: str, request: StreamRequest, max_tokens: int) -> dict[str, Any]:
    """The OpenAI chat request: messages, budget, greedy, streamed with the usage at the end."""
    assert request.prompt.messages is not None  # guaranteed by StreamRequest
    return {"model": model, "messages": [{"role": r, "content": c} for r, c in request.prompt.messages],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}


def read_stream(lines: Any, sent: float, what: str) -> PlainRecord:
    """The server-sent events of one streamed completion -> its record (``sent``: perf_counter at sending)."""
    first: float | None = None
    tokens: int | None = None
    prompt: int | None = None
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            break
        try:
            chunk = json.loads(data)
        except ValueError:
            raise RemoteError(f"{what}: a streamed chunk is not JSON: {data[:80]!r}") from None
        choices = chunk.get("choices") or []
        if first is None and any((c.get("delta") or {}).get("content") for c in choices):
            first = time.perf_counter()
        usage = chunk.get("usage")
        if isinstance(usage, dict) and "completion_tokens" in usage:
            tokens = int(usage["completion_tokens"])
            prompt = int(usage["prompt_tokens"]) if "prompt_tokens" in usage else None
    if tokens is None:
        raise RemoteError(f"{what}: the stream ended without usage.completion_tokens")
    return PlainRecord(completion_tokens=tokens, ttft_s=(first if first is not None else time.perf_counter()) - sent,
                       prompt_tokens=prompt)


class PlainClient:
    """``ReplayClient``'s face for ``loadtest`` (``http``, ``model_name``, ``chat``) over plain OpenAI requests."""

    def __init__(self, settings: ReplaySettings, transport: Any = None) -> None:
        self.settings = settings
        self.http = _httpx().Client(base_url=settings.url, timeout=settings.timeout_s, transport=transport)

    def __enter__(self) -> PlainClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.http.close()

    def model_name(self) -> str:
        """The first model ``/v1/models`` lists (llama-server names its GGUF file)."""
        httpx = _httpx()
        try:
            listing = self.http.get("/v1/models").json()
            return str(listing["data"][0]["id"])
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            raise RemoteError(f"{self.settings.url}/v1/models lists no model ({type(exc).__name__})") from None

    def chat(self, model: str, request: StreamRequest, mode: str) -> PlainRecord:
        """One streamed completion (``mode`` is the label's, not sent: the server has one)."""
        httpx = _httpx()
        what = f"request {request.index} ({request.prompt.id}) to {self.settings.url}"
        sent = time.perf_counter()
        try:
            with self.http.stream("POST", "/v1/chat/completions",
                                  json=request_body(model, request, self.settings.max_tokens)) as response:
                if response.status_code != 200:
                    response.read()
                    raise RemoteError(f"{what} answered HTTP {response.status_code}: {_error_message(response)}")
                return read_stream(response.iter_lines(), sent, what)
        except httpx.HTTPError as exc:
            raise RemoteError(f"{what} failed ({type(exc).__name__}: {exc}); is the server still up?") from None
