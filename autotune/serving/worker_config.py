"""How a decode worker is set up (``WorkerConfig``, frozen and checked) and what it calls back (``Hooks``)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from autotune.errors import SettingError
from autotune.tuning.controller import ControlSettings
from autotune.tuning.load import ROUTE_MIN_DRAFTS

MAX_DECODERS = 8  # decoders kept per worker (each holds its drafter's caches), least recently used out
FAILING_AFTER = 3  # internal decode failures in a row after which /health answers 503 ("failing")


@dataclass(frozen=True)
class WorkerConfig:
    """One decode worker: its queue, its batch, and how it chooses each step's draft lengths."""

    max_queue: int = 64  # requests waiting; one more is answered 503
    max_batch: int = 1  # requests decoded side by side
    max_batch_rows: int | None = None  # target rows a step may verify (None: no limit)
    load_aware: bool = True  # draft lengths shrink with load (``autotune.tuning.load``)
    # per-request control of routed requests (None: off, every request keeps its strategy)
    control: ControlSettings | None = field(default_factory=ControlSettings)
    acceptance_min_drafts: int = ROUTE_MIN_DRAFTS  # drafted tokens before a route's live acceptance speaks
    max_decoders: int = MAX_DECODERS
    prefix_cache_bytes: int = 0  # K/V rows kept across requests (``runtime.prefix_cache``); 0: none

    def __post_init__(self) -> None:
        for name in ("max_queue", "max_batch", "acceptance_min_drafts", "max_decoders"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SettingError(f"decode worker setting {name}={value!r} must be a positive integer")
        if isinstance(self.prefix_cache_bytes, bool) or not isinstance(self.prefix_cache_bytes, int) \
                or self.prefix_cache_bytes < 0:
            raise SettingError(f"decode worker setting prefix_cache_bytes={self.prefix_cache_bytes!r} must be an "
                               "integer >= 0 (0: no prefix cache)")
        if self.max_batch_rows is not None and self.max_batch_rows < 1:
            raise SettingError(f"decode worker setting max_batch_rows={self.max_batch_rows} must be at least 1")


@dataclass(frozen=True)
class Hooks:
    """What the decode thread calls back (metrics, tests); each is optional."""

    on_done: Callable[[Any, Any], None] | None = None  # (job, outcome) once a request's answer is ready
    on_step: Callable[[list[Any]], None] | None = None  # after each batched step, with the requests it advanced
    on_control: Callable[[Any], None] | None = None  # after a controlled request decoded
    # after each prompt chunk run while a batch runs, but a first one run alone: True where it rode a step's forward
    on_prefill_chunk: Callable[[bool], None] | None = None
    # a fault-injection point for tests, called on the decode thread before each request;
    # nothing reachable over HTTP sets it
    fault: Callable[[Any], None] | None = None
