"""One re-tune of adaptive serving: the online tuner on a route's live requests, and what its
result is checked with before it is stored (``timed``: greedy outputs and time on the first
requests it tuned on, for the lossless check and the like-for-like speed comparison)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from autotune.serving.jobs import cluster_key
from autotune.timing import Stopwatch
from autotune.tuning.tuner import OnlineTuner
from runtime.decoding import Decoder, GenerationConfig, GenerationResult
from runtime.stats import DecodeStats
from search_spaces.strategy import PLAIN, Strategy


@dataclass
class Retune:
    """The online tuner on one route's live requests."""

    route: str  # the route re-tuned (``unknown``: a new route)
    task: str  # the store key's task it will be recorded under (a new route's: checked again at the write)
    decoder: Decoder
    tuner: OnlineTuner
    prompts: list[str]  # routing texts stored with the result (the entry's, then the requests')
    supersedes: int | None
    reason: str
    cluster: int | None = None  # the pending cluster of unknown traffic it turns into a route
    stored: Strategy = PLAIN  # the route's stored strategy when it started
    stored_acceptance: float | None = None  # the stored strategy's greedy acceptance on this route lately
    keep_ids: int = 2  # prompts kept for the lossless check
    requests: int = 0
    wall_s: float = 0.0
    stats: DecodeStats = field(default_factory=DecodeStats)
    ids: list[list[int]] = field(default_factory=list)  # the first requests' prompts (the check's)
    eos: tuple[int, ...] = ()

    @property
    def key(self) -> str:
        """Its key among the running re-tunes: the route, or its pending cluster's (``jobs.cluster_key``)."""
        return self.route if self.cluster is None else cluster_key(self.cluster)

    def generate(self, ids: list[int], cfg: Any, stored_text: str, after_round: Callable | None) -> GenerationResult:
        self.tuner.start_prompt(len(ids))
        with Stopwatch() as decoding:
            result = self.decoder.generate(ids, cfg, before_round=self.tuner.before_round, after_round=after_round)
            self.tuner.end_prompt(ids + result.tokens, result.stats)
        self.wall_s += decoding.seconds
        self.requests += 1
        self.stats = self.stats.merge(result.stats)
        self.prompts.append(stored_text)
        if len(self.ids) < self.keep_ids:
            self.ids.append(list(ids))
            self.eos = tuple(cfg.eos_token_ids)
        return result

    def plain_tps(self) -> float | None:
        """Plain decoding's speed on these requests (the tuner's incumbent until a candidate won)."""
        plain = self.tuner.kept[0]
        return plain.recent_tps or plain.measured_tps

    def outcome(self) -> tuple[Strategy, float, float | None, float | None]:
        """-> (strategy to store, its measured tokens/s, acceptance, predicted tokens/s): the
        tuner's pick when it measured faster than plain decoding on these requests, else plain."""
        tuner = self.tuner
        plain_tps = self.plain_tps() or 0.0
        best = next((k for k in reversed(tuner.kept) if k.strategy == tuner.best), tuner.kept[0])
        if best.strategy.speculates and (best.measured_tps or 0.0) > plain_tps:
            return best.strategy, best.measured_tps or 0.0, best.acceptance, tuner.predicted_tps(best.strategy)
        return PLAIN, plain_tps, None, plain_tps or None


@dataclass(frozen=True)
class Run:
    """Greedy outputs of one decoder on a re-tune's check prompts, and what decoding them took."""

    outputs: tuple[tuple[int, ...], ...]
    tokens: int
    seconds: float

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def timed(decoder: Decoder, prompts: list[list[int]], eos: tuple[int, ...], tokens: int) -> Run:
    """Decode ``prompts`` greedily (``tokens`` each) with ``decoder``: their outputs and time."""
    cfg = GenerationConfig(max_new_tokens=tokens, eos_token_ids=eos)
    outputs, n, decoding = [], 0, Stopwatch()
    for ids in prompts:
        with decoding:
            result = decoder.generate(ids, cfg)
        outputs.append(tuple(result.tokens))
        n += len(result.tokens)
    return Run(tuple(outputs), n, decoding.seconds)
