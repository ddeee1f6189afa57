"""The replay client: send a request stream to a running ``autotune serve`` in several modes.

Every request of the stream is sent once per mode (``auto``, ``plain``, ``default`` or a stored
strategy id: the per-request ``{"autotune": {"strategy": MODE}}`` override), interleaved per request
(request 0 in every mode, one after another, then request 1, ...; the order rotates from one request
to the next, ``send_order``) so the modes see the same server state, greedily (temperature 0) with
the completion's token ids returned. With ``repeat`` above 1 each request goes round its modes that
many times, the order reversed on every second round, and the report takes each mode's median over
its sends (:func:`autotune.reports.replay_report.combined`). The mode ``chosen`` sends the request
again right after its ``auto`` one, forcing the strategy ``auto`` started it on (``forced_mode``):
what ``auto``'s routing, clustering and control cost beside the same strategy.
Requests go with ``"cache_prompt": false`` unless ``cache_prompt``: a mode sent after another would
otherwise find the first one's prompt in the server's prefix cache and look faster. :mod:`autotune.reports.replay_report` turns the
records into the per-category report; the outputs must be identical across modes. The command
(``autotune replay``, :mod:`autotune.cli.replay`) exits 1 when any differ. Only the server does model
work: this is an HTTP client (``httpx``).
"""
from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, TypeVar
from urllib.parse import urlsplit

from autotune.choices import STRATEGY_CHOICES
from autotune.errors import MethodError, RemoteError, SettingError
from studies.stream import StreamRequest
from studies.stream_request import conversations

DEFAULT_MODES: tuple[str, ...] = ("auto", "plain", "default")
T = TypeVar("T")
CHOSEN = "chosen"  # the strategy ``auto`` started a request on, forced (sent right after the ``auto`` one)


def check_mode(mode: str) -> str:
    """``mode`` when the server's per-request override takes it (a choice or a stored id), or ``chosen``."""
    if mode in STRATEGY_CHOICES or mode.isdigit() or mode == CHOSEN:
        return mode
    raise MethodError(f"unknown mode {mode!r}; modes are {', '.join(STRATEGY_CHOICES)}, a stored strategy id "
                      f"(`autotune strategies list`) or {CHOSEN} (auto's choice, forced)")


def parse_modes(text: str) -> tuple[str, ...]:
    """``"auto,plain"`` -> ``("auto", "plain")``: known modes, each once, at least one."""
    modes = tuple(part.strip() for part in text.split(",") if part.strip())
    if not modes:
        raise MethodError(f"--mode takes a comma list such as {','.join(DEFAULT_MODES)}, got {text!r}")
    repeated = [m for i, m in enumerate(modes) if m in modes[:i]]
    if repeated:
        raise MethodError(f"mode {repeated[0]!r} is listed twice in --mode; list each mode once")
    if CHOSEN in modes and "auto" not in modes[:modes.index(CHOSEN)]:
        raise MethodError(f"mode {CHOSEN} forces what auto chose: list auto before it, e.g. auto,{CHOSEN},plain")
    return tuple(check_mode(m) for m in modes)


def base_url(url: str) -> str:
    """The server's root URL: ``http://host:port`` (a trailing ``/`` or ``/v1`` dropped)."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise SettingError(f"--url must be an http(s) URL such as http://127.0.0.1:8000, got {url!r}")
    root = url.strip().rstrip("/")
    return root.removesuffix("/v1")


@dataclass(frozen=True)
class ReplaySettings:
    """Where to send the stream and how; ``model=None`` takes the server's one model."""

    url: str
    model: str | None = None
    modes: tuple[str, ...] = DEFAULT_MODES
    concurrency: int = 1
    max_tokens: int = 96
    timeout_s: float = 600.0
    cache_prompt: bool = False  # let requests reuse the server's prefix cache (see the module's docstring)
    repeat: int = 1  # rounds of a request's modes (``replay``)

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", base_url(self.url))
        object.__setattr__(self, "modes", parse_modes(",".join(self.modes)))
        for name, value in (("concurrency", self.concurrency), ("max tokens", self.max_tokens),
                            ("repeat", self.repeat)):
            if value < 1:
                raise SettingError(f"{name} must be at least 1, got {value}")
        if self.timeout_s <= 0:
            raise SettingError(f"timeout must be above 0 seconds, got {self.timeout_s}")


@dataclass(frozen=True)
class ReplayRecord:
    """One response: which request, in which mode, and the server's ``autotune`` figures."""

    index: int
    category: str
    mode: str
    prompt_id: str
    completion_tokens: int
    route: str | None
    distance: float | None
    strategy: str
    state: str
    drafted: int
    accepted: int
    draft_rounds: int
    tokens_per_s: float
    ttft_s: float
    latency_s: float
    token_ids: tuple[int, ...]
    # what the request's controller did (routed requests of a server with request control)
    control_switches: int | None = None
    control_final: str | None = None
    control_s: float = 0.0  # its scoring time
    control_start: str | None = None  # the strategy its controller started it on (``controller.label``)
    control_prior: str | None = None  # its route's strategy (``controller.label``)
    cluster: int | None = None  # the pending cluster an ``unknown`` request joined (``serve --adaptive``)
    tuning_s: float | None = None  # a re-tune's request: the tuning time it carried (``serve --adaptive``)
    prefix_tokens: int = 0  # prompt tokens whose rows came from the server's prefix cache
    send: int = 0  # the round of the request's modes this answer came from (``replay``'s repeat), 0 first
    # where its time to the first token went (the server's ``stages``: queue, admit, prefill, start)
    stages: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_response(cls, request: StreamRequest, mode: str, body: dict[str, Any]) -> ReplayRecord:
        info = body.get("autotune")
        if not isinstance(info, dict) or "token_ids" not in info:
            raise RemoteError(f"request {request.index} ({mode}): the response has no autotune object with token ids; "
                              "is the server `autotune serve`?")
        control, tuning = info.get("control"), info.get("tuning")
        try:
            extra = {} if not isinstance(control, dict) else dict(
                control_switches=int(control["switches"]), control_final=str(control["final"]),
                control_s=float(control["scoring_s"]), control_start=_text(control.get("start")),
                control_prior=_text(control.get("prior")))
            return cls(
                index=request.index, category=request.category, mode=mode, prompt_id=request.prompt.id,
                completion_tokens=int(body["usage"]["completion_tokens"]), route=info.get("route"),
                distance=info.get("distance"), strategy=str(info["strategy"]), state=str(info.get("state", "stored")),
                drafted=int(info["drafted"]), accepted=int(info["accepted"]), draft_rounds=int(info["draft_rounds"]),
                tokens_per_s=float(info["tokens_per_s"]), ttft_s=float(info["ttft_s"]),
                latency_s=float(info["latency_s"]), token_ids=tuple(int(t) for t in info["token_ids"]),
                cluster=None if info.get("cluster") is None else int(info["cluster"]),
                tuning_s=float(tuning["tuning_s"]) if isinstance(tuning, dict) else None,
                prefix_tokens=int(info.get("prefix_tokens", 0)),
                stages={str(k): float(v) for k, v in (info.get("stages") or {}).items()}, **extra,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise RemoteError(f"request {request.index} ({mode}): malformed response ({type(exc).__name__}: {exc}); "
                              "is the server `autotune serve`?") from None

    @property
    def decode_s(self) -> float:
        """The decoder's time on this request (tokens / its tok/s): queueing and HTTP left out."""
        return self.completion_tokens / self.tokens_per_s if self.tokens_per_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "token_ids": list(self.token_ids), "decode_s": self.decode_s}

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> ReplayRecord:
        """The record ``as_dict`` wrote (a ``--json`` file's ``records``); derived keys are dropped."""
        names = {f.name for f in fields(cls)}
        return cls(**{**{k: v for k, v in row.items() if k in names}, "token_ids": tuple(row["token_ids"])})


def _httpx() -> Any:
    try:
        import httpx
    except ImportError:
        raise MethodError("autotune replay needs the httpx package; run `pip install httpx`") from None
    return httpx


def _body(response: Any, what: str) -> Any:
    """The JSON body of a 200 response, or a RemoteError naming ``what`` was asked."""
    try:
        return response.json()
    except ValueError:
        raise RemoteError(f"{what} answered with something other than JSON; is --url an `autotune serve` server?") from None


class ReplayClient:
    """The HTTP side: the server's model name, one chat request per (request, mode), /health."""

    def __init__(self, settings: ReplaySettings, transport: Any = None) -> None:
        """``transport``: an ``httpx`` transport to send through instead of the network (tests)."""
        httpx = _httpx()
        self.settings = settings
        self.http = httpx.Client(base_url=settings.url, timeout=settings.timeout_s, transport=transport)

    def __enter__(self) -> ReplayClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.http.close()

    def _get(self, path: str) -> Any:
        httpx = _httpx()
        try:
            response = self.http.get(path)
        except httpx.HTTPError as exc:
            raise RemoteError(f"cannot reach autotune serve at {self.settings.url} ({type(exc).__name__}); "
                              "start it with `autotune serve` or check --url") from None
        if response.status_code != 200:
            raise RemoteError(f"GET {self.settings.url}{path} answered HTTP {response.status_code}; "
                              "is --url an `autotune serve` server?")
        return _body(response, f"GET {self.settings.url}{path}")

    def model_name(self) -> str:
        """``settings.model``, or the one model the server lists (this also checks it is reachable)."""
        listing = self._get("/v1/models")
        data = listing.get("data") if isinstance(listing, dict) else None
        names = [m.get("id") for m in data or [] if isinstance(m, dict)]
        if self.settings.model is not None:
            return self.settings.model
        if not names or not isinstance(names[0], str):
            raise RemoteError(f"{self.settings.url}/v1/models lists no model; pass --model NAME")
        return names[0]

    def route_retunes(self) -> dict[str, int] | None:
        """Re-tunes per route from GET /health (``serve --adaptive``); None when it reports none."""
        health = self._get("/health")
        routes = health.get("routes") if isinstance(health, dict) else None
        if not isinstance(routes, dict):
            return None
        return {str(r): int(v.get("retunes") or 0) for r, v in routes.items() if isinstance(v, dict)}

    def stored_tasks(self) -> list[str] | None:
        """The stored tasks the server routes to, from GET /health; None when it reports none."""
        health = self._get("/health")
        tasks = health.get("tasks") if isinstance(health, dict) else None
        return [str(t) for t in tasks] if isinstance(tasks, list) else None

    def reset_cache(self) -> bool:
        """Ask the server to keep no K/V rows of earlier requests (``POST /reset_prefix_cache``) ->
        whether it did (False: a server without that endpoint)."""
        httpx = _httpx()
        try:
            response = self.http.post("/reset_prefix_cache")
        except httpx.HTTPError as exc:
            raise RemoteError(f"cannot reach autotune serve at {self.settings.url} ({type(exc).__name__}); "
                              "is the server still up?") from None
        if response.status_code in (404, 405):
            return False
        if response.status_code != 200:
            raise RemoteError(f"POST {self.settings.url}/reset_prefix_cache answered HTTP {response.status_code}: "
                              f"{_error_message(response)}")
        return True

    def chat(self, model: str, request: StreamRequest, mode: str) -> ReplayRecord:
        httpx = _httpx()
        assert request.prompt.messages is not None  # guaranteed by StreamRequest
        body = {"model": model, "messages": [{"role": r, "content": c} for r, c in request.prompt.messages],
                "max_tokens": self.settings.max_tokens, "temperature": 0,
                "autotune": {"strategy": mode, "return_token_ids": True}, "cache_prompt": self.settings.cache_prompt}
        try:
            response = self.http.post("/v1/chat/completions", json=body)
        except httpx.HTTPError as exc:
            raise RemoteError(f"request {request.index} ({mode}) to {self.settings.url} failed "
                              f"({type(exc).__name__}: {exc}); is the server still up?") from None
        if response.status_code != 200:
            raise RemoteError(f"request {request.index} ({request.prompt.id}, mode {mode}) answered HTTP "
                              f"{response.status_code}: {_error_message(response)}")
        return ReplayRecord.from_response(request, mode, _body(response, f"request {request.index} ({mode})"))


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


def _error_message(response: Any) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200].replace("\n", " ")


Send = Callable[[StreamRequest, str], ReplayRecord]


def forced_mode(auto: ReplayRecord) -> str | None:
    """The mode that forces the strategy ``auto`` started this request on: ``plain`` when its
    controller started it plainly, else its route's strategy (``plain``, ``default`` or a stored
    id). None when that cannot be forced the same: a re-tune's request, or a controller that started
    elsewhere (a route's moved prior) or switched on the way (the forced one would decode otherwise)."""
    if auto.state != "stored" or auto.control_switches:
        return None
    if auto.control_start == "plain":
        return "plain"
    if auto.control_start is not None and auto.control_start != auto.control_prior:
        return None
    return auto.strategy if auto.strategy in ("plain", "default") or auto.strategy.isdigit() else None


def send_order(modes: Sequence[str], index: int, round_: int = 0) -> list[str]:
    """The order request ``index``'s modes are sent in: ``modes`` rotated by ``index``, so each mode
    goes first as often as the others over a stream (whatever drifts during a request's sends - the
    machine's clock, another tenant - falls on every mode alike); backwards in the request's odd
    rounds (``replay``'s repeat), so over two rounds every mode's mean place is the same and a steady
    drift falls on each mode's mean alike; ``chosen`` stays right after ``auto``, whose choice it
    forces."""
    units: list[list[str]] = []
    for mode in modes:
        if mode == CHOSEN:  # parse_modes puts auto before it
            next(u for u in units if "auto" in u).append(mode)
        else:
            units.append([mode])
    order = rotated(units, index)
    return [m for unit in (order[::-1] if round_ % 2 else order) for m in unit]


def rotated(items: Sequence[T], round_: int) -> list[T]:
    """The order of ``items`` (modes) in round ``round_`` (0-based): each round starts one item
    later, so none always runs first (on the server as the previous traffic left it) or last."""
    k = round_ % len(items) if items else 0
    return list(items[k:]) + list(items[:k])


def replay(requests: Sequence[StreamRequest], modes: Sequence[str], send: Send, concurrency: int = 1,
           progress: Callable[[ReplayRecord], None] | None = None, repeat: int = 1) -> list[ReplayRecord]:
    """Send every request in every mode with ``send``, ``repeat`` rounds of its modes one after
    another (each round in ``send_order``; its records' ``send`` is the round); ``concurrency``
    requests at a time, a conversation's requests in order from one sender -> the records by
    request, each request's in the order sent (``chosen`` only where ``forced_mode`` could force
    the same round's ``auto``)."""
    def one(request: StreamRequest) -> list[ReplayRecord]:
        out: list[ReplayRecord] = []
        for round_ in range(repeat):
            auto = None
            for mode in send_order(modes, request.index, round_):
                if mode == CHOSEN:
                    forced = forced_mode(auto) if auto is not None else None
                    if forced is None:
                        continue
                    record = replace(send(request, forced), mode=CHOSEN)
                else:
                    record = send(request, mode)
                auto = record if mode == "auto" else auto
                out.append(_noted(replace(record, send=round_), progress))
        return out

    if concurrency == 1:
        return [r for request in requests for r in one(request)]
    with cf.ThreadPoolExecutor(max_workers=concurrency) as pool:
        sent = [r for records in pool.map(lambda unit: [r for q in unit for r in one(q)], conversations(requests))
                for r in records]
    return sorted(sent, key=lambda r: r.index)  # stable: a request's modes stay in order


def _noted(record: ReplayRecord, progress: Callable[[ReplayRecord], None] | None) -> ReplayRecord:
    if progress is not None:
        progress(record)
    return record
