"""A load test of a running ``autotune serve``: closed-loop clients, one mode and one concurrency
at a time -> aggregate throughput and latency per (server, mode, concurrency).

Modes are measured side by side: at each concurrency every mode runs in turn, ``rounds`` times
(each round in a rotated order), and a mode's point pools its rounds; ``warmup`` requests per mode
run unmeasured before a server's first point.

Each point sends ``requests-per-client x concurrency`` requests, and at least ``min-requests`` (a point
of one client and two requests measures two prompts, which decide it), taken from the stream one category
at a time in turn (:func:`interleaved`: the ``mixed`` stream comes in blocks of one category, and its
first requests alone would make a low-concurrency point measure one task): ``concurrency``
clients each send their next request as soon as their last one is answered. Reported: aggregate tok/s (tokens
of all responses / wall time), requests/s, p50 / p95 latency and p50 time to first token as the
client saw them, and, from the server's ``/metrics`` (before and after the point), the mean batch
size and target rows per decode step (absent on a server without batching).

:func:`compare` sets one mode against the best of the others at each concurrency: the pooled ratio,
each round's ratio (the modes of a round ran back to back on the same requests, so a round's ratio
is a paired measurement) and a 95% interval on their geometric mean, which says whether a margin
stands out of the rounds' noise.

Peers (``peers``: another engine's server, e.g. each llama-server configuration of
:mod:`autotune.measure.llama_server`) speak no ``autotune`` extension: each is started (afresh for
each pass), measured as one mode (``PEER_MODE``, plain OpenAI requests) and stopped, after the
servers, one at a time. No pass finds prompts an earlier one left cached (``load_test``). With
peers measured, :func:`compare` also sets the mode against the best peer at each concurrency; their
rounds did not run back to back, so that interval is Welch's on the rounds' logarithms (unpaired).
"""
from __future__ import annotations

import logging
import math
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

from autotune.measure.replay import ReplayClient, ReplaySettings, rotated
from studies.prompt import render_prompt
from studies.stream import StreamRequest
from studies.stream_request import conversations

log = logging.getLogger("autotune.loadtest")
PEER_MODE = "peer"  # the one mode a peer is measured in (no mode of ours is spelled so)
STEP_METRICS = ("autotune:batch_size_sum", "autotune:batch_size_count", "autotune:batch_rows_sum")
DRAFT_METRICS = ("autotune:step_draft_tokens_sum", "autotune:step_draft_tokens_count")  # summed over routes


@dataclass(frozen=True)
class LoadPoint:
    server: str  # the label of the server measured
    mode: str
    concurrency: int
    requests: int
    tokens: int
    wall_s: float
    tokens_per_s: float
    requests_per_s: float
    latency_p50_s: float
    latency_p95_s: float
    ttft_p50_s: float
    mean_batch: float | None  # requests per decode step, from /metrics
    rows_per_step: float | None  # target rows per decode step
    draft_per_request: float | None = None  # tokens drafted per request and step (load-aware lengths)
    rounds: int = 1  # passes of the point's requests pooled into it
    round_tokens_per_s: tuple[float, ...] = ()  # each pass's aggregate tok/s (its spread is the point's noise)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Comparison:
    """``mode`` against ``against``, the other mode of the best pooled tok/s at the same server and
    concurrency, or (``paired`` False) the peer server of the best pooled tok/s at that concurrency.
    ``ratio`` is pooled (tok/s over tok/s); ``round_ratios`` pair the two passes of the same round;
    ``low`` / ``high`` bound their geometric mean (95%, Student's t on the logarithms; unpaired:
    Welch's t on the two sets of rounds' logarithms), None with fewer than two rounds."""

    server: str
    concurrency: int
    mode: str
    against: str
    ratio: float
    round_ratios: tuple[float, ...]
    low: float | None
    high: float | None
    paired: bool = True  # False: against a peer, whose rounds ran apart from the mode's

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _interval(ratios: Sequence[float], level: float = 0.95) -> tuple[float | None, float | None]:
    """A ``level`` confidence interval on the geometric mean of ``ratios`` (t on their logarithms)."""
    if len(ratios) < 2 or min(ratios) <= 0:
        return None, None
    from scipy.stats import t

    logs = [math.log(r) for r in ratios]
    half = float(t.ppf(0.5 + level / 2, len(logs) - 1)) * statistics.stdev(logs) / math.sqrt(len(logs))
    mean = statistics.fmean(logs)
    return math.exp(mean - half), math.exp(mean + half)


def _unpaired_interval(a: Sequence[float], b: Sequence[float],
                       level: float = 0.95) -> tuple[float | None, float | None]:
    """A ``level`` confidence interval on the ratio of the geometric means of ``a`` and ``b``
    (Welch's t on their logarithms: two independent sets of rounds)."""
    if len(a) < 2 or len(b) < 2 or min(*a, *b) <= 0:
        return None, None
    from scipy.stats import t

    la, lb = [math.log(x) for x in a], [math.log(x) for x in b]
    va, vb = statistics.variance(la) / len(la), statistics.variance(lb) / len(lb)
    diff = statistics.fmean(la) - statistics.fmean(lb)
    if va + vb == 0:
        return math.exp(diff), math.exp(diff)
    df = (va + vb) ** 2 / (va**2 / (len(la) - 1) + vb**2 / (len(lb) - 1))
    half = float(t.ppf(0.5 + level / 2, df)) * math.sqrt(va + vb)
    return math.exp(diff - half), math.exp(diff + half)


def _against(p: LoadPoint, best: LoadPoint, paired: bool) -> Comparison:
    ratios = [a / b for a, b in zip(p.round_tokens_per_s, best.round_tokens_per_s) if b > 0]
    low, high = _interval(ratios) if paired else _unpaired_interval(p.round_tokens_per_s, best.round_tokens_per_s)
    return Comparison(p.server, p.concurrency, p.mode, best.mode if paired else best.server,
                      p.tokens_per_s / best.tokens_per_s, tuple(ratios), low, high, paired)


def compare(points: Sequence[LoadPoint], mode: str = "auto") -> list[Comparison]:
    """``mode``'s point against the best other mode's at each (server, concurrency) that measured
    ``mode`` and at least one other mode; then, where peers were measured, against the best peer
    (``PEER_MODE`` points, any peer server) at each concurrency."""
    ours = [p for p in points if p.mode == mode]
    peers = [p for p in points if p.mode == PEER_MODE]
    out = []
    for p in ours:
        others = [o for o in points if o.server == p.server and o.concurrency == p.concurrency
                  and o.mode not in (mode, PEER_MODE)]
        if others:
            out.append(_against(p, max(others, key=lambda o: o.tokens_per_s), paired=True))
    for p in ours:
        rivals = [o for o in peers if o.concurrency == p.concurrency]
        if rivals:
            out.append(_against(p, max(rivals, key=lambda o: o.tokens_per_s), paired=False))
    return out


def format_comparisons(comparisons: Sequence[Comparison]) -> str:
    lines = ["| server | concurrency | mode | against (best other mode, or best peer) | ratio | ratio by round "
             "| 95% interval |",
             "|---|---|---|---|---|---|---|"]
    for c in comparisons:
        rounds = " / ".join(f"{r:.3f}" for r in c.round_ratios) or "-"
        interval = "-" if c.low is None else f"{c.low:.3f} - {c.high:.3f}" + ("" if c.paired else " (unpaired)")
        lines.append(f"| {c.server} | {c.concurrency} | {c.mode} | {c.against} | {c.ratio:.3f} | {rounds} | {interval} |")
    return "\n".join(lines)


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def step_counters(client: ReplayClient) -> dict[str, float] | None:
    """The batching counters of the server's /metrics, or None when it has none."""
    response = client.http.get("/metrics")
    if response.status_code != 200:
        return None
    found: dict[str, float] = {}
    for line in response.text.splitlines():
        name, _, value = line.rpartition(" ")
        name = name.split("{", 1)[0]
        if name in STEP_METRICS + DRAFT_METRICS:
            found[name] = found.get(name, 0.0) + float(value)
    return found if all(n in found for n in STEP_METRICS) else None


@dataclass(frozen=True)
class _Sample:
    """One pass of a point's requests: what the clients saw and the server's step counters moved."""

    done: tuple[tuple[float, float, int], ...]  # (latency, ttft, tokens) per request
    wall_s: float
    counters: dict[str, float] | None  # /metrics deltas over the pass (None: a server without batching)


def _send(client: ReplayClient, model: str, requests: Sequence[StreamRequest], mode: str, concurrency: int) -> _Sample:
    """Send every request in ``mode`` from ``concurrency`` closed-loop clients."""
    before = step_counters(client)
    pending = conversations(requests)  # a client takes a whole conversation: its turns in order
    lock = threading.Lock()
    done: list[tuple[float, float, int]] = []  # (latency, ttft, tokens)
    failed: list[BaseException] = []

    def client_loop() -> None:
        while True:
            with lock:
                if not pending or failed:
                    return
                unit = pending.pop(0)
            for request in unit:
                sent = time.perf_counter()
                try:
                    record = client.chat(model, request, mode)
                except BaseException as exc:  # reported once every client stopped
                    with lock:
                        failed.append(exc)
                    return
                latency = time.perf_counter() - sent
                # the server's ttft counts from the request's arrival, as the client's latency does
                with lock:
                    done.append((latency, record.ttft_s, record.completion_tokens))

    start = time.perf_counter()
    threads = [threading.Thread(target=client_loop, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if failed:
        raise failed[0]
    after = step_counters(client)
    counters = None
    if before is not None and after is not None:
        counters = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in set(before) | set(after)}
    return _Sample(tuple(done), wall, counters)


def _point(samples: Sequence[_Sample], server: str, mode: str, concurrency: int) -> LoadPoint:
    """The pooled point of one or more passes of the same requests (tokens and wall time summed,
    latencies pooled, step counters summed)."""
    done = [d for s in samples for d in s.done]
    wall = sum(s.wall_s for s in samples)
    mean_batch = rows = drafts = None
    if all(s.counters is not None for s in samples):
        def total(name: str) -> float:
            return sum((s.counters or {}).get(name, 0.0) for s in samples)

        steps = total("autotune:batch_size_count")
        if steps > 0:
            mean_batch = total("autotune:batch_size_sum") / steps
            rows = total("autotune:batch_rows_sum") / steps
        if total("autotune:step_draft_tokens_count") > 0:
            drafts = total("autotune:step_draft_tokens_sum") / total("autotune:step_draft_tokens_count")
    tokens = sum(n for *_, n in done)
    latencies = [lat for lat, _, _ in done]
    return LoadPoint(
        server=server, mode=mode, concurrency=concurrency, requests=len(done), tokens=tokens, wall_s=wall,
        tokens_per_s=tokens / wall, requests_per_s=len(done) / wall, latency_p50_s=statistics.median(latencies),
        latency_p95_s=_quantile(latencies, 0.95), ttft_p50_s=statistics.median(t for _, t, _ in done),
        mean_batch=mean_batch, rows_per_step=rows, draft_per_request=drafts, rounds=len(samples),
        round_tokens_per_s=tuple(round(sum(n for *_, n in s.done) / s.wall_s, 3) for s in samples),
    )


def measure_point(client: ReplayClient, model: str, requests: Sequence[StreamRequest], mode: str, concurrency: int,
                  server: str = "server") -> LoadPoint:
    """Send every request in ``mode`` from ``concurrency`` closed-loop clients, once."""
    return _point([_send(client, model, requests, mode, concurrency)], server, mode, concurrency)


def interleaved(requests: Sequence[StreamRequest]) -> list[StreamRequest]:
    """``requests`` one category at a time in turn (categories in order of first appearance, each
    category's requests in stream order; a conversation's requests stay together): every prefix is
    as mixed as the stream allows."""
    by_category: dict[str, list[list[StreamRequest]]] = {}
    for unit in conversations(requests):
        by_category.setdefault(unit[0].category, []).append(unit)
    queues = list(by_category.values())
    out: list[StreamRequest] = []
    for i in range(max((len(q) for q in queues), default=0)):
        out.extend(r for q in queues if i < len(q) for r in q[i])
    return out


def first_requests(requests: Sequence[StreamRequest], n: int) -> list[StreamRequest]:
    """The first ``n`` of ``requests``, and the rest of the conversation the ``n``-th one is part of."""
    taken = list(requests[:n])
    if taken and taken[-1].conversation is not None:
        last = taken[-1].conversation
        for r in requests[n:]:
            if r.conversation != last:
                break
            taken.append(r)
    return taken


def point_size(concurrency: int, per_client: int, min_requests: int) -> int:
    """Requests a point of ``concurrency`` clients sends."""
    return max(per_client * concurrency, min_requests)


def warm_requests(requests: Sequence[StreamRequest], measured: int, n: int) -> list[StreamRequest]:
    """The ``n`` warm-up requests: of those past the first ``measured`` (all of them where none are),
    the ones whose prompt shares the shortest leading text with any measured prompt, in stream order
    among equals. A server keeps a warm-up's prompt (our prefix cache is reset after it, llama-server's
    slots are not), so a warm-up that opened like a measured request (GSM8K's few-shot examples) would
    let that server skip the request's prefill."""
    spare = list(requests[measured:]) or list(requests)
    texts = [render_prompt(r.prompt, None) for r in requests[:measured]]

    def shared(request: StreamRequest) -> int:
        text = render_prompt(request.prompt, None)
        return max((len(os.path.commonprefix([text, t])) for t in texts), default=0)

    return sorted(spare, key=shared)[:n]  # sorted() is stable: stream order among equals


def _warm(client: Any, model: str, warm: Sequence[StreamRequest], modes: Sequence[str]) -> None:
    """``warm``'s requests in every mode from one client, not measured."""
    for mode in modes:
        if warm:
            _send(client, model, warm, mode, 1)


Passes = Callable[[], AbstractContextManager[tuple[Any, str]]]
"""Opens one pass of a point's requests: -> (client, model name), on a server holding nothing of an
earlier pass (ours: its caches reset; a peer: a fresh process)."""


def _measure_server(passes: Passes, label: str, requests: Sequence[StreamRequest], modes: Sequence[str],
                    levels: Sequence[int], per_client: int, min_requests: int, rounds: int,
                    progress: Callable[[LoadPoint], None] | None) -> list[LoadPoint]:
    """Every (mode, concurrency) point of one server, each pass opened by ``passes``."""
    points = []
    for level in levels:
        batch = first_requests(requests, point_size(level, per_client, min_requests))
        samples: dict[str, list[_Sample]] = {mode: [] for mode in modes}
        for r in range(rounds):
            for mode in rotated(modes, r):
                with passes() as (client, model):
                    samples[mode].append(_send(client, model, batch, mode, level))
        for mode in modes:
            point = _point(samples[mode], label, mode, level)
            points.append(point)
            if progress is not None:
                progress(point)
    return points


@contextmanager
def _reset_pass(client: ReplayClient, model: str, label: str) -> Iterator[tuple[Any, str]]:
    """A pass on our running server after its prefix cache is reset (``POST /reset_prefix_cache``)."""
    if not client.reset_cache():
        log.warning("%s has no /reset_prefix_cache: a pass may find prompts an earlier pass left cached", label)
    yield client, model


@contextmanager
def _fresh_pass(peer: Any, max_tokens: int, timeout_s: float,
                warm: Sequence[StreamRequest]) -> Iterator[tuple[Any, str]]:
    """A pass on a fresh process of ``peer``, warmed up first."""
    from autotune.measure.openai_client import PlainClient

    with peer.start() as url, PlainClient(ReplaySettings(url=url, max_tokens=max_tokens, timeout_s=timeout_s)) \
            as client:
        model = client.model_name()
        _warm(client, model, warm, (PEER_MODE,))
        yield client, model


def load_test(servers: Sequence[tuple[str, str]], requests: Sequence[StreamRequest], modes: Sequence[str],
              levels: Sequence[int], max_tokens: int, timeout_s: float,
              progress: Callable[[LoadPoint], None] | None = None, per_client: int = 2,
              min_requests: int = 1, rounds: int = 1, warmup: int = 0, peers: Sequence[Any] = ()) -> list[LoadPoint]:
    """Every (server, mode, concurrency) point (``servers``: (label, url) pairs); a point sends
    ``per_client`` x its concurrency requests, and at least ``min_requests`` (the first ones of
    ``interleaved(requests)``, and the rest of the last one's conversation).

    Modes are measured side by side: at each concurrency, ``rounds`` passes of every mode in turn
    (``rotated``: each round starts one mode later), and a point pools its mode's passes. Before a
    server's first point, ``warmup`` requests per mode from one client, not measured (``warm_requests``:
    past the largest point's requests, opening least like them): a fresh server's first requests
    run slower (measured: plain at 1 client 5.4-7.5 tok/s as the first point of a run).

    No pass finds what an earlier pass left: the levels, rounds and modes repeat the same requests,
    and a server that kept their rows would skip their prefill. Our servers' prefix caches are reset
    before each pass (``POST /reset_prefix_cache``; within a pass, a request reuses what the pass's
    earlier ones left, as users' traffic does). Then each of ``peers`` (``label`` and ``start()``, a
    context manager that runs the server and yields its URL, e.g. ``llama_server.PeerServer``), one
    at a time: a fresh process for each pass (llama-server keeps prompts in its slots and its RAM
    cache, and ngram-mod its n-gram pool), warmed up, measured in the one mode ``PEER_MODE`` with
    plain OpenAI requests, stopped before the next starts."""
    requests = interleaved(requests)
    needed = max((len(first_requests(requests, point_size(level, per_client, min_requests))) for level in levels),
                 default=0)
    warm = warm_requests(requests, needed, warmup)
    shared = dict(requests=requests, levels=levels, per_client=per_client, min_requests=min_requests,
                  rounds=rounds, progress=progress)
    points = []
    for label, url in servers:
        with ReplayClient(ReplaySettings(url=url, max_tokens=max_tokens, timeout_s=timeout_s, cache_prompt=True)) \
                as client:  # served as users send: a later request reuses what an earlier one of its pass left
            model = client.model_name()
            _warm(client, model, warm, modes)
            points += _measure_server(partial(_reset_pass, client, model, label), label, modes=modes, **shared)
    for peer in peers:
        points += _measure_server(partial(_fresh_pass, peer, max_tokens, timeout_s, warm), peer.label,
                                  modes=(PEER_MODE,), **shared)
    return points


def format_points(points: Sequence[LoadPoint]) -> str:
    lines = ["| server | mode | concurrency | requests | tok/s | req/s | p50 latency s | p95 latency s | p50 TTFT s "
             "| mean batch | rows / step | drafted / request / step | tok/s by round |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        batch = "-" if p.mean_batch is None else f"{p.mean_batch:.1f}"
        rows = "-" if p.rows_per_step is None else f"{p.rows_per_step:.1f}"
        drafts = "-" if p.draft_per_request is None else f"{p.draft_per_request:.2f}"
        by_round = " / ".join(f"{x:.2f}" for x in p.round_tokens_per_s) or "-"
        lines.append(f"| {p.server} | {p.mode} | {p.concurrency} | {p.requests} | {p.tokens_per_s:.2f} | "
                     f"{p.requests_per_s:.3f} | {p.latency_p50_s:.2f} | {p.latency_p95_s:.2f} | {p.ttft_p50_s:.2f} | "
                     f"{batch} | {rows} | {drafts} | {by_round} |")
    return "\n".join(lines)


def read_points(path: Any) -> list[LoadPoint]:
    """The points a ``loadtest --json`` file holds."""
    import json

    try:
        data = json.loads(open(path).read())
        return [LoadPoint(**{**p, "round_tokens_per_s": tuple(p.get("round_tokens_per_s", ()))})
                for p in data["points"]]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        from autotune.errors import SettingError

        raise SettingError(f"cannot read load-test points from {path}: {exc}; pass a file `loadtest --json` wrote") from None
