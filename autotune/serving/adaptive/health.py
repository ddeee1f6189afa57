"""A route's health under adaptive serving, and the drift rule (``judge``).

Judged like with like: a route's requests are split into two **bands**, greedy (temperature 0) and
sampled. Acceptance falls when sampling even on unchanged traffic, so the acceptance a strategy was
stored with (measured greedily by ``study``) is compared with the greedy band only; the sampled
band is compared with its own first judged figure. Each band is also compared with plain
decoding's speed **on this route** (``RouteHealth.plain_tps``: its requests decoded plainly, auto-
routed or during a re-tune), never with clients' ``"plain"`` overrides of other lengths; until the
route has one, with the cost model's timed plain step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from autotune.serving.adaptive.settings import AdaptSettings
from runtime.stats import DecodeStats
from search_spaces.strategy import Strategy


def ewma(old: float | None, new: float, weight: float) -> float:
    return new if old is None else (1.0 - weight) * old + weight * new


@dataclass
class Band:
    """What one temperature band of a route's requests measured."""

    acceptance: float | None = None
    tps: float | None = None
    requests: int = 0

    def observe(self, stats: DecodeStats, weight: float) -> None:
        self.requests += 1
        if stats.drafted:
            self.acceptance = ewma(self.acceptance, stats.acceptance_rate, weight)
        if stats.decode_tokens_per_s:
            self.tps = ewma(self.tps, stats.decode_tokens_per_s, weight)


@dataclass
class RouteHealth:
    """What a route measured since its strategy was stored (or re-tuned)."""

    route: str
    strategy: Strategy
    label: str  # the stored row's id, or "plain"
    stored_acceptance: float | None  # the greedy band's reference (None: its first judged figure)
    history_id: int | None = None  # the stored best's history row (what a re-tune supersedes)
    tps: float | None = None  # every band's requests together (what /health shows)
    requests: int = 0
    retunes: int = 0
    fallbacks: int = 0
    reason: str = ""  # why it last re-tuned
    plain_tps: float | None = None  # plain decoding on this route's own requests
    sampled_reference: float | None = None  # the sampled band's reference: its first judged figure
    greedy: Band = field(default_factory=Band)
    sampled: Band = field(default_factory=Band)

    @property
    def acceptance(self) -> float | None:
        """The greedy band's acceptance (what the stored figure is compared with)."""
        return self.greedy.acceptance

    def observe(self, stats: DecodeStats, weight: float, sampled: bool = False) -> None:
        self.requests += 1
        (self.sampled if sampled else self.greedy).observe(stats, weight)
        if stats.decode_tokens_per_s:
            self.tps = ewma(self.tps, stats.decode_tokens_per_s, weight)

    def observe_plain(self, stats: DecodeStats, weight: float) -> None:
        """One of this route's requests decoded plainly (any temperature: plain costs the same)."""
        if stats.decode_tokens_per_s:
            self.plain_tps = ewma(self.plain_tps, stats.decode_tokens_per_s, weight)


def judge(health: RouteHealth, plain_tps: float | None, settings: AdaptSettings) -> str | None:
    """Why ``health``'s route must re-tune now, or None: the server's drift rule. Its one side
    effect: a band without a reference acceptance takes its first judged figure as one."""
    if not health.strategy.speculates:  # nothing to drift: re-check now and then whether speculation pays
        if health.requests >= settings.recheck_plain_requests:
            return f"plain for {health.requests} requests: re-checking whether speculation pays"
        return None
    for band, sampled in ((health.greedy, False), (health.sampled, True)):
        if band.requests < settings.min_requests:
            continue
        which = " on sampled requests" if sampled else ""
        if plain_tps and band.tps is not None and band.tps < (1.0 - settings.slower_margin) * plain_tps:
            return f"slower than plain{which} ({band.tps:.2f} < {plain_tps:.2f} tok/s)"
        if band.acceptance is None:
            continue
        reference = health.sampled_reference if sampled else health.stored_acceptance
        if reference is None:  # the first judged figure is the reference
            if sampled:
                health.sampled_reference = band.acceptance
            else:
                health.stored_acceptance = band.acceptance
            continue
        bar = min((1.0 - settings.acceptance_drop) * reference, reference - settings.acceptance_floor_drop)
        if band.acceptance < bar:
            source = "first sampled" if sampled else "stored"
            return f"acceptance{which} {band.acceptance:.2f} < {bar:.2f} ({source} {reference:.2f})"
    return None
