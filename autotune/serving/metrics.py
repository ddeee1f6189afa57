"""Prometheus metrics of the server (``GET /metrics``), labelled by route.

The speculative-decoding counters use vLLM's names under our prefix, so dashboards built for vLLM's
``vllm:spec_decode_*`` read them with the prefix changed:
``autotune:spec_decode_num_drafts_total`` (verify passes that checked drafts),
``autotune:spec_decode_num_draft_tokens_total``, ``autotune:spec_decode_num_accepted_tokens_total``
and ``autotune:spec_decode_num_accepted_tokens_per_pos_total{position}``.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from runtime.stats import DecodeStats

PREFIX = "autotune:"
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
DISTANCE_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.65, 0.7, 0.8, 0.9, 1.0)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
ROW_BUCKETS = (0, 1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40)


class ServingMetrics:
    """One registry per server (tests start several in one process)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        route = ["route"]
        self.drafts = Counter(f"{PREFIX}spec_decode_num_drafts", "Verify passes that checked draft tokens", route, registry=r)
        self.draft_tokens = Counter(f"{PREFIX}spec_decode_num_draft_tokens", "Draft tokens verified", route, registry=r)
        self.accepted = Counter(f"{PREFIX}spec_decode_num_accepted_tokens", "Draft tokens accepted", route, registry=r)
        self.accepted_per_pos = Counter(f"{PREFIX}spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position", route + ["position"], registry=r)
        self.generation_tokens = Counter(f"{PREFIX}generation_tokens", "Tokens generated", route, registry=r)
        self.requests = Counter(f"{PREFIX}requests", "Requests answered, by outcome", route + ["finish_reason"], registry=r)
        self.cancelled = Counter(f"{PREFIX}requests_cancelled", "Requests withdrawn before their end, by reason "
                                 "(client_disconnected, timeout)", ["reason"], registry=r)
        self.errors = Counter(f"{PREFIX}request_errors", "Requests refused or failed, by HTTP status", ["status"], registry=r)
        self.latency = Histogram(f"{PREFIX}request_latency_seconds", "Request accepted -> last token", route,
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram(f"{PREFIX}time_to_first_token_seconds", "Request accepted -> first token", route,
                              buckets=TTFT_BUCKETS, registry=r)
        self.route_distance = Histogram(f"{PREFIX}route_distance", "Cosine distance of auto-routed prompts to their "
                                        "nearest task centroid", route, buckets=DISTANCE_BUCKETS, registry=r)
        self.queue_depth = Gauge(f"{PREFIX}queue_depth", "Requests waiting or being decoded", registry=r)
        self.decoders = Gauge(f"{PREFIX}decoders", "Decoders the worker keeps (each with its caches)", registry=r)
        self.verify_widths = Gauge(f"{PREFIX}verify_widths", "Verify widths the target is packed for (one "
                                   "packed copy each; bounded to 1)", registry=r)
        self.retunes = Counter(f"{PREFIX}route_retunes", "Re-tunes started on live traffic (drift, or a new route)",
                               route, registry=r)
        self.store_writes = Counter(f"{PREFIX}store_writes", "Adaptive serving's store writes, by outcome (stored; "
                                    "failed: one failed attempt, retried; dropped: given up)", ["outcome"], registry=r)
        self.store_writes_pending = Gauge(f"{PREFIX}store_writes_pending", "Store writes waiting for the writer "
                                          "thread", registry=r)
        self.batch_size = Histogram(f"{PREFIX}batch_size", "Requests advanced by each decode step", buckets=BATCH_BUCKETS,
                                    registry=r)
        self.batch_rows = Histogram(f"{PREFIX}batch_rows", "Target rows each decode step verified (1 per plain "
                                    "request, 1 + drafted per speculative one)", buckets=ROW_BUCKETS, registry=r)
        self.prefill_chunks = Counter(f"{PREFIX}prefill_chunks", "Prompt chunks prefilled alone between decode steps "
                                      "(a prompt longer than --prefill-chunk on a target whose rows are not reusable: "
                                      "its chunks after the first)", registry=r)
        self.prefill_chunks_in_steps = Counter(f"{PREFIX}prefill_chunks_in_steps", "Prompt chunks prefilled inside a "
                                               "decode step's target forward, beside the running requests' rows (a "
                                               "target whose rows are reusable)", registry=r)
        self.draft_length = Histogram(f"{PREFIX}step_draft_tokens", "Tokens drafted per request and step, by route",
                                      route, buckets=ROW_BUCKETS, registry=r)
        self.switches = Counter(f"{PREFIX}request_strategy_switches", "Strategy switches inside requests (the "
                                "per-request controller), by route", route, registry=r)
        self.controlled = Counter(f"{PREFIX}controlled_requests", "Requests the per-request controller drove, by route "
                                  "and final strategy", route + ["final"], registry=r)
        self.speculation_stopped = Counter(f"{PREFIX}speculation_stopped", "Requests whose speculation measured slower "
                                           "than plain decoding and stopped", route, registry=r)
        self.control_seconds = Counter(f"{PREFIX}request_control_seconds", "Time the per-request controllers spent "
                                       "scoring", route, registry=r)
        self.strategy = Info(f"{PREFIX}route_strategy", "The strategy each route decodes with", route, registry=r)

    def observe(self, route: str, stats: DecodeStats, finish_reason: str, latency_s: float, ttft_s: float,
                distance: float | None = None) -> None:
        if distance is not None:
            self.route_distance.labels(route).observe(distance)
        self.drafts.labels(route).inc(stats.draft_rounds)
        self.draft_tokens.labels(route).inc(stats.drafted)
        self.accepted.labels(route).inc(stats.accepted)
        for pos, n in enumerate(stats.position_accepted):
            self.accepted_per_pos.labels(route, str(pos)).inc(n)
        self.generation_tokens.labels(route).inc(stats.new_tokens)
        self.requests.labels(route, finish_reason).inc()
        self.latency.labels(route).observe(latency_s)
        self.ttft.labels(route).observe(ttft_s)

    def observe_step(self, batch: list[Any]) -> None:
        """After a decode step (``Hooks.on_step``): its batch size, rows, and draft lengths."""
        rows = 0
        for r in batch:
            n = r.member.decoder.last_rows
            rows += n
            self.draft_length.labels(r.job.choice.route).observe(n - 1)
        self.batch_size.observe(len(batch))
        self.batch_rows.observe(rows)

    def observe_prefill_chunk(self, rode: bool) -> None:
        """After a prompt chunk ran while a batch was running (``Hooks.on_prefill_chunk``)."""
        (self.prefill_chunks_in_steps if rode else self.prefill_chunks).inc()

    def observe_control(self, job: Any) -> None:
        """After a controlled request decoded: its switches, final strategy, stop and scoring time."""
        c, route = job.control, job.choice.route
        if c is None:
            return
        self.switches.labels(route).inc(c["switches"])
        self.controlled.labels(route, c["final"]).inc()
        if c["stopped"]:
            self.speculation_stopped.labels(route).inc()
        self.control_seconds.labels(route).inc(c["scoring_s"])

    def set_strategy(self, route: str, label: str, strategy_json: str) -> None:
        self.strategy.labels(route).info({"strategy": label, "json": strategy_json})

    def watch_prefix_cache(self, prefix: Any) -> None:
        """Export ``prefix``'s figures (a ``runtime.prefix_cache.PrefixCache``), read at each scrape."""
        self.registry.register(_PrefixCacheCollector(prefix))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _PrefixCacheCollector:
    """The prefix cache's counters and sizes, from its own statistics (no second bookkeeping)."""

    def __init__(self, prefix: Any) -> None:
        self.prefix = prefix

    def collect(self) -> Iterator[Any]:
        st = self.prefix.stats
        for name, doc, value in (
            ("lookups", "Prompts that looked for cached rows", st.lookups),
            ("hits", "Prompts that reused cached rows", st.hits),
            ("tokens_looked_up", "Prompt tokens that could have been reused (all but each prompt's last)",
             st.tokens_looked_up),
            ("tokens_reused", "Prompt tokens whose K/V rows came from the prefix cache, not a prefill", st.tokens_reused),
            ("evictions", "Cached blocks dropped for room (least recently used first)", st.evictions),
        ):
            yield CounterMetricFamily(f"{PREFIX}prefix_cache_{name}", doc, value=value)
        for name, doc, value in (
            ("bytes", "Bytes of K/V rows the prefix cache holds", st.used_bytes),
            ("budget_bytes", "The prefix cache's budget (--prefix-cache-gib)", st.budget_bytes),
            ("blocks", "Blocks of K/V rows the prefix cache holds", st.blocks),
            ("hit_rate", "Share of the prompt tokens that could have been reused that were", st.hit_rate),
        ):
            yield GaugeMetricFamily(f"{PREFIX}prefix_cache_{name}", doc, value=value)
