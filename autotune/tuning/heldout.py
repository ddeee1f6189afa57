"""Out-of-sample judgement of a study: which strategy is fastest on the *task*, not on the prompts
it was tuned on.

A strategy that wins on the prompts the tuner saw can lose on the next ones (prompt lookup picked
where a few completions copied their prompt), so a study keeps part of its prompts away from the
tuner (``split_prompts``: every third, at least ``MIN_HELD`` where there are enough) and decodes
them, after tuning, with plain decoding, the tuner's incumbent and the best-scored candidate of
each other drafter kind (``autotune.tuning.candidates.runner_ups``), interleaved prompt by prompt
(``judge_on``).

``choose`` then stores the candidate with the highest **lower confidence bound** on its per-prompt
speed-up over plain decoding: the mean of ``log(speed-up)`` over the held-out prompts minus
``Z`` standard errors (the per-prompt spread over the square root of their number, never below
``NOISE_FLOOR``, this machine's run-to-run noise on one prompt). Between two candidates whose means
differ by less than their spread, the one that varies less across prompts wins; plain decoding's
bound is 0 (its speed-up is 1 on every prompt), so a speculating candidate is stored only when its
bound is above 0: plain decoding wins ties. A candidate whose output differed from plain decoding
on any prompt is never stored (lossless).

The stored speed-up comes with an ``INTERVAL`` interval from its prompts (``interval``: Student's t
over the per-prompt log speed-ups) and a note of what it rests on (``rests_on``).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from runtime.stats import DecodeStats
from search_spaces.strategy import PLAIN, Strategy

HOLD_EVERY = 3  # every third prompt is held out of tuning
MIN_HELD = 2  # at least this many held out, where tuning keeps MIN_TUNED
MIN_TUNED = 2
Z = 1.0  # the bound: one standard error below the mean log speed-up
NOISE_FLOOR = 0.03  # spread of log speed-ups assumed at least (one prompt's run-to-run noise here)
INTERVAL = 0.95  # the stated interval of the stored strategy's speed-up on the task
FEW_PROMPTS = 5  # below this many held-out prompts, the report says the figure rests on few


def split_prompts(n: int, every: int = HOLD_EVERY, min_held: int = MIN_HELD) -> tuple[list[int], list[int]]:
    """-> (indices tuned on, indices held out) of ``n`` prompts, the same for the same ``n``.

    Every ``every``-th prompt is held out (indices ``every-1, 2*every-1, ...``); more are taken
    from the end until ``min_held`` are, while at least ``MIN_TUNED`` remain to tune on; with 2
    prompts one is held out, with 1 none (the judgement is then in-sample, and says so)."""
    if every < 2:
        raise ValueError(f"every={every} must be >= 2 (something has to be tuned on)")
    held = [i for i in range(n) if i % every == every - 1]
    for i in range(n - 1, -1, -1):
        if len(held) >= min_held or n - len(held) - 1 < MIN_TUNED:
            break
        if i not in held:
            held.append(i)
    if not held and n >= 2:
        held = [n - 1]
    held.sort()
    return [i for i in range(n) if i not in held], held


@dataclass
class Candidate:
    """A strategy decoded on the held-out prompts: its stats there, prompt by prompt."""

    strategy: Strategy
    label: str  # "plain", "incumbent", "runner-up"
    predicted_tps: float | None = None  # the tuner's corrected prediction for the task (decode rounds)
    runs: list[DecodeStats] = field(default_factory=list)  # one per held-out prompt
    identical: bool = True  # every output equalled plain decoding's
    # (tokens, predicted seconds) per held-out prompt: the cost model's price of the text it decoded
    # there (its own matches on that text), set apart from how the task's text varies
    priced: list[tuple[int, float]] = field(default_factory=list)

    @property
    def text_tps(self) -> float | None:
        """Predicted decode tokens/s on the held-out prompts' own text (``priced``)."""
        n, secs = sum(t for t, _ in self.priced), sum(s for _, s in self.priced)
        return n / secs if secs > 0 else None

    @property
    def stats(self) -> DecodeStats:
        total = DecodeStats()
        for s in self.runs:
            total = total.merge(s)
        return total

    def as_dict(self, plain: "Candidate") -> dict[str, Any]:
        ups = speedups(self, plain)
        return {"label": self.label, "strategy": self.strategy.to_dict(), "identical": self.identical,
                "tps": [s.tokens_per_s for s in self.runs], "speedups": ups,
                "speedup": aggregate_speedup(self, plain),
                "bound": lower_bound(ups) if self.strategy.speculates else 0.0,  # plain's: 0 (the bar)
                "predicted_tps": self.predicted_tps, "text_predicted_tps": self.text_tps,
                "decode_tps": self.stats.decode_tokens_per_s,
                "stats": self.stats.as_dict()}


def speedups(candidate: Candidate, plain: Candidate) -> list[float]:
    """Per held-out prompt: the candidate's tokens/s over plain decoding's on the same prompt."""
    return [c.tokens_per_s / p.tokens_per_s if p.tokens_per_s else 0.0 for c, p in zip(candidate.runs, plain.runs)]


def aggregate_speedup(candidate: Candidate, plain: Candidate) -> float:
    """Tokens/s over all held-out prompts against plain decoding's (what ``bench`` reports)."""
    p = plain.stats.tokens_per_s
    return candidate.stats.tokens_per_s / p if p else 0.0


def lower_bound(ups: Sequence[float], z: float = Z, floor: float = NOISE_FLOOR) -> float:
    """Mean log speed-up minus ``z`` standard errors (spread never below ``floor``); -inf when a
    prompt did not run."""
    if not ups or any(u <= 0 for u in ups):
        return -math.inf
    mean, se = _log_mean_se(ups, floor)
    return mean - z * se


def _log_mean_se(ups: Sequence[float], floor: float = NOISE_FLOOR) -> tuple[float, float]:
    """Mean of the log speed-ups and its standard error (the spread never below ``floor``)."""
    logs = [math.log(u) for u in ups]
    mean = sum(logs) / len(logs)
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (len(logs) - 1)) if len(logs) > 1 else 0.0
    return mean, max(sd, floor) / math.sqrt(len(logs))


def interval(candidate: Candidate, plain: Candidate, level: float = INTERVAL) -> tuple[float, float] | None:
    """A ``level`` interval for the candidate's speed-up on the task, from its held-out prompts:
    the aggregate speed-up times ``exp(+-t * s / sqrt(n))``, ``s`` the spread of the per-prompt log
    speed-ups (never below ``NOISE_FLOOR``) and ``t`` Student's quantile for ``n - 1`` degrees of
    freedom (3 prompts: t = 4.30 at 95%, a wide interval, as it should be). None below 2 prompts."""
    from scipy.stats import t as student

    ups = speedups(candidate, plain)
    if len(ups) < 2 or any(u <= 0 for u in ups):
        return None
    _, se = _log_mean_se(ups)
    half = float(student.ppf(0.5 + level / 2, len(ups) - 1)) * se
    centre = aggregate_speedup(candidate, plain)
    return centre * math.exp(-half), centre * math.exp(half)


def rests_on(verdict: "Verdict") -> str:
    """What the stored figure rests on: the held-out prompts and tokens behind it, and a warning
    where they are few."""
    runs = verdict.chosen.runs
    n, tokens = len(runs), sum(r.new_tokens for r in runs)
    text = f"{n} held-out prompt(s), {tokens} tokens"
    if verdict.in_sample:
        return f"{n} prompt the tuner saw (nothing held out): an in-sample figure"
    if n < FEW_PROMPTS:
        text += (f"; fewer than {FEW_PROMPTS} prompts: the interval is wide and the figure is a sample of "
                 "this task, not its mean (--limit 15 holds out 5)")
    return text


@dataclass(frozen=True)
class Verdict:
    """What the held-out judgement stores, why, and what every candidate did."""

    chosen: Candidate
    reason: str
    candidates: tuple[Candidate, ...]  # plain first
    in_sample: bool  # no prompt could be held out: judged on a prompt the tuner saw

    @property
    def plain(self) -> Candidate:
        return self.candidates[0]

    @property
    def speedup(self) -> float:
        return aggregate_speedup(self.chosen, self.plain)

    @property
    def interval(self) -> tuple[float, float] | None:
        """The stored strategy's speed-up interval (``interval``); plain decoding's is exactly 1."""
        if not self.chosen.strategy.speculates:
            return (1.0, 1.0)
        return interval(self.chosen, self.plain)

    def as_dict(self) -> dict[str, Any]:
        return {"chosen": self.chosen.label, "reason": self.reason, "in_sample": self.in_sample,
                "prompts": len(self.plain.runs), "speedup": self.speedup,
                "interval": list(self.interval) if self.interval else None, "level": INTERVAL,
                "rests_on": rests_on(self),
                "candidates": [c.as_dict(self.plain) for c in self.candidates]}


def choose(plain: Candidate, others: Sequence[Candidate], in_sample: bool = False) -> Verdict:
    """The candidate with the highest lower bound on its per-prompt speed-up (plain decoding's is
    0: it wins ties); one whose output ever differed from plain decoding is never chosen."""
    best, best_bound, reason = plain, 0.0, "plain decoding (no candidate's held-out speed-up was above its spread)"
    differed = [c for c in others if c.strategy.speculates and not c.identical]
    for c in others:
        if not c.strategy.speculates or not c.identical:
            continue
        bound = lower_bound(speedups(c, plain))
        if bound > best_bound:
            best, best_bound = c, bound
            reason = (f"the {c.label} (held-out speed-up {aggregate_speedup(c, plain):.2f}x, "
                      f"lower bound {math.exp(bound):.2f}x)")
    if best is plain and differed:
        reason = ("plain decoding: the output of the " + ", ".join(c.label for c in differed)
                  + " differed from plain decoding, so it was not stored")
    return Verdict(best, reason, (plain, *others), in_sample)


Decode = Callable[[Strategy, list[int]], tuple[list[int], DecodeStats]]  # (strategy, prompt) -> (tokens, stats)


def judge_on(prompts: Sequence[list[int]], candidates: Sequence[Candidate], decode: Decode) -> None:
    """Decode every prompt with every candidate (``candidates[0]`` is plain decoding), the order
    rotated prompt by prompt so that going first or last cancels (this machine's speed drifts);
    fills each candidate's ``runs`` and ``identical``."""
    n = len(candidates)
    for i, ids in enumerate(prompts):
        outputs: dict[int, list[int]] = {}
        stats: dict[int, DecodeStats] = {}
        for j in range(n):
            c = (i + j) % n
            outputs[c], stats[c] = decode(candidates[c].strategy, ids)
        for c in range(n):
            candidates[c].runs.append(stats[c])
            candidates[c].identical &= outputs[c] == outputs[0]


def describe(strategy: Strategy) -> str:
    """A short name: drafter, length, and what else is set (threshold, tree, layer plan)."""
    if not strategy.speculates:
        return "plain"
    parts = [f"{strategy.drafter} k={strategy.draft_length}"]
    if strategy.drafter in ("draft-model", "layer-skip") and strategy.confidence_threshold:
        parts.append(f"eps={strategy.confidence_threshold:g}")
    if strategy.tree_widths:
        parts.append("tree " + "x".join(map(str, strategy.tree_widths[:4])))
    if strategy.layer_plan is not None and not strategy.layer_plan.is_identity:
        parts.append("layer plan")
    if strategy.lookup_first:
        parts.append("lookup first")
    return " ".join(parts)


def plain_candidate() -> Candidate:
    return Candidate(PLAIN, "plain")
