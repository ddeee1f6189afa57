"""The OpenAI wire format: request bodies (validated), error bodies and response objects.

Requests are pydantic models: a malformed body is a 400 with OpenAI's error shape
``{"error": {"message", "type", "param", "code"}}`` before anything reaches the decode worker.
Unknown fields (``user``, ``presence_penalty``...) are accepted and ignored, except those whose
meaning we cannot honour: ``n`` > 1, ``best_of`` > 1 and the ``UNSUPPORTED`` features are refused by
name, since a client that asked for log-probabilities or a JSON schema and silently got none would
be misled.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from autotune.choices import STRATEGY_CHOICES  # or a stored strategy id (autotune strategies list)

MAX_ID = 2**63 - 1  # store ids and seeds are signed 64-bit integers (SQLite, PostgreSQL, torch)
MAX_STOPS, MAX_STOP_CHARS = 64, 256  # each stop string is searched for after every round
# OpenAI features this server does not implement; a request that turns one on is refused by name
UNSUPPORTED = ("logprobs", "top_logprobs", "logit_bias", "tools", "tool_choice", "response_format")


class ApiError(Exception):
    """An OpenAI-style error response: ``status`` and the body's fields."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class AutotuneOptions(BaseModel):
    """The per-request override: ``{"autotune": {"strategy": "auto|plain|default|ID"}}``."""

    model_config = ConfigDict(extra="forbid")
    strategy: str | int = "auto"
    return_token_ids: bool = False  # the completion's token ids in the response's autotune object

    @field_validator("strategy")
    @classmethod
    def _known_form(cls, v: str | int) -> str:
        text = str(v).strip()
        # isascii: "²".isdigit() is True but int("²") fails; MAX_ID: larger ids overflow the store's column
        is_id = text.isascii() and text.isdigit() and len(text) <= len(str(MAX_ID)) and int(text) <= MAX_ID
        if text in STRATEGY_CHOICES or is_id:
            return text
        raise ValueError(f"must be one of {', '.join(STRATEGY_CHOICES)} or a stored strategy id, got {v!r}")


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=MAX_ID)
    stop: str | list[str] | None = None
    stream: bool = False
    # llama-server's name: false, and this request neither reuses cached prompt rows nor leaves its own
    cache_prompt: bool = True
    n: int = 1
    best_of: int | None = None
    # declared only to be refused by name when set (``_unsupported``)
    logprobs: Any = None
    top_logprobs: Any = None
    logit_bias: Any = None
    tools: Any = None
    tool_choice: Any = None
    response_format: Any = None
    autotune: AutotuneOptions = Field(default_factory=AutotuneOptions)

    @field_validator("max_tokens", "max_completion_tokens", check_fields=False)  # the latter: chat only
    @classmethod
    def _positive(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"must be at least 1, got {v}")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [] if v is None else [v] if isinstance(v, str) else list(v)
        if len(stops) > MAX_STOPS or any(not 0 < len(s) <= MAX_STOP_CHARS for s in stops):
            raise ValueError(f"takes up to {MAX_STOPS} non-empty strings of at most {MAX_STOP_CHARS} characters")
        return stops

    @field_validator(*UNSUPPORTED, mode="before", check_fields=False)
    @classmethod
    def _unsupported(cls, v: Any, info: ValidationInfo) -> Any:
        if v is None or v is False:  # an explicit "off" (e.g. logprobs: false) asks for nothing
            return v
        raise ValueError(f"{info.field_name} is not supported by this server; leave it out of the request")

    @model_validator(mode="after")
    def _one_choice(self) -> "_Common":
        if self.n != 1 or (self.best_of not in (None, 1)):
            raise ValueError("n and best_of must be 1: this server returns one choice per request")
        return self


class CompletionRequest(_Common):
    prompt: str | list[str]
    max_tokens: int | None = 16  # OpenAI's default for completions

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[str]) -> str:
        if isinstance(v, list):
            if len(v) != 1:
                raise ValueError("give one prompt string (batches of prompts are not served)")
            v = v[0]
        if not v:
            raise ValueError("must not be empty")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer"]
    content: str


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens

    @model_validator(mode="after")
    def _budget(self) -> "ChatCompletionRequest":
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


def validation_error(errors: list[dict[str, Any]]) -> ApiError:
    """pydantic/FastAPI validation errors -> one 400 naming the first bad field."""
    first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return ApiError(400, "the request body is not valid JSON", None, code="invalid_json")
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    where = f"'{param}': " if param else ""
    return ApiError(400, f"{where}{msg}", param, code="invalid_value" if param else None)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def completion_body(kind: str, rid: str, model: str, text: str, finish: str | None, usage: dict[str, int],
                    extra: dict[str, Any]) -> dict[str, Any]:
    """A whole (non-streamed) response. ``kind``: ``text_completion`` or ``chat.completion``."""
    if kind == "chat.completion":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": [choice],
            "usage": usage, "autotune": extra}


def chunk_body(kind: str, rid: str, model: str, text: str | None, finish: str | None,
               first: bool = False) -> dict[str, Any]:
    """One SSE chunk. ``kind``: ``text_completion`` or ``chat.completion.chunk``."""
    if kind == "chat.completion.chunk":
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": [choice]}
