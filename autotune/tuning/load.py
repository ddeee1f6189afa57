"""Speculation that adapts to load: how many tokens each sequence of a batch drafts this step.

A batched step costs its drafting (per sequence, sequential draft forwards) plus one target forward
over every sequence's rows. :class:`StepCost` prices that forward as a function of the batch's rows
and sequences (least squares over a start-up profile and the real steps since), and
:func:`choose_lengths` picks each sequence's draft length (up to its strategy's, or none) to
maximise the batch's goodput: expected tokens per second over the whole step (SmartSpec's goodput
model; Leviathan's expected accepted length per sequence, ``(1 - a^(k+1)) / (1 - a)``).

The best length falls as the batch grows: rows that were nearly free at batch 1 (a verify of 8 rows
costs about one row's forward on CPU) compete with batch-mates' plain rows at batch 16.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from search_spaces.strategy import Strategy

STEPS_KEPT = 256  # real steps the step cost is fitted on (with the start-up profile)
PRIOR_DRAFTS = 8  # pseudo-drafts of the route's acceptance before a sequence's own rounds count
DEFAULT_ACCEPTANCE = 0.6  # a sequence of a route that stored no acceptance


@dataclass(frozen=True)
class Candidate:
    """One sequence's choice this step: up to ``max_length`` draft tokens."""

    acceptance: float  # per-token acceptance estimate (0..1)
    max_length: int  # its strategy's draft length (0: plain decoding)
    draft_token_s: float  # seconds to draft one token (0 for prompt lookup)
    rows: Callable[[int], int] = lambda k: 1 + k  # target rows of a draft of length k (a tree has more)


def strategy_rows(strategy: Strategy) -> Callable[[int], int]:
    """Target rows of ``strategy``'s draft cut to length ``k``: ``1 + k`` for a chain, a tree's
    nodes down to depth ``k`` plus one."""
    widths = strategy.tree_widths
    if not strategy.speculates or not widths:
        return lambda k: 1 + k

    def rows(k: int) -> int:
        total, level = 1, 1
        for w in widths[:k]:
            level *= w
            total += level
        return total

    return rows


def expected_tokens(acceptance: float, length: int) -> float:
    """Tokens a round appends with a chain of ``length`` drafts at per-token ``acceptance``."""
    a = min(max(acceptance, 0.0), 0.999)
    return (1 - a ** (length + 1)) / (1 - a)


def acceptance_estimate(prior: float | None, accepted: int, drafted: int) -> float:
    """The route's acceptance as a prior of ``PRIOR_DRAFTS`` drafts, updated by the sequence's own."""
    p = DEFAULT_ACCEPTANCE if prior is None else prior
    return (p * PRIOR_DRAFTS + accepted) / (PRIOR_DRAFTS + drafted)


class StepCost:
    """Seconds of a batched target forward: ``base + per_row * rows + per_seq * sequences``."""

    def __init__(self, profile: Sequence[tuple[int, int, float]] = ()) -> None:
        self.profile = list(profile)  # (rows, sequences, seconds) timed at start-up
        self.steps: deque[tuple[int, int, float]] = deque(maxlen=STEPS_KEPT)
        self.coef = np.array([0.0, 0.0, 0.0])
        self._fit()

    def observe(self, rows: int, sequences: int, seconds: float) -> None:
        self.steps.append((rows, sequences, seconds))
        if len(self.steps) % 16 == 0:
            self._fit()

    def predict(self, rows: int, sequences: int) -> float:
        return float(self.coef @ np.array([1.0, rows, sequences]))

    def _fit(self) -> None:
        data = self.profile + list(self.steps)
        if len(data) < 3:
            return
        x = np.array([[1.0, r, s] for r, s, _ in data])
        y = np.array([t for *_, t in data])
        coef, *_ = np.linalg.lstsq(x, y, rcond=None)
        self.coef = np.maximum(coef, 0.0)  # costs do not fall with more rows
        if self.coef[0] <= 0:
            self.coef[0] = float(y.min())


def choose_lengths(candidates: Sequence[Candidate], cost: StepCost, max_rows: int | None = None) -> list[int]:
    """Each candidate's draft length this step, maximising expected tokens per second over the
    batch: lengths grow one token at a time, the most profitable first, while the goodput rises
    and the step's rows stay within ``max_rows``."""
    lengths = [0] * len(candidates)
    room = None if max_rows is None else max_rows - len(candidates)  # draft rows left beyond one per sequence

    def goodput(ks: list[int]) -> float:
        rows = sum(c.rows(k) for c, k in zip(candidates, ks))
        seconds = cost.predict(rows, len(ks)) + sum(c.draft_token_s * k for c, k in zip(candidates, ks))
        tokens = sum(expected_tokens(c.acceptance, k) for c, k in zip(candidates, ks))
        return tokens / max(seconds, 1e-9)

    best = goodput(lengths)
    while True:
        gains = []
        for i, c in enumerate(candidates):
            if lengths[i] < c.max_length:
                trial = lengths.copy()
                trial[i] += 1
                extra = c.rows(trial[i]) - c.rows(lengths[i])
                if room is not None and sum(c.rows(k) - 1 for c, k in zip(candidates, lengths)) + extra > room:
                    continue
                gains.append((goodput(trial), i))
        if not gains:
            return lengths
        value, i = max(gains)
        if value <= best:
            return lengths
        best, lengths[i] = value, lengths[i] + 1


SCHEDULE_BATCHES = (1, 2, 4, 8, 16, 32, 64)  # batch sizes a vLLM schedule is derived at


def batch_schedule(acceptance: float, max_length: int, cost: StepCost, draft_step_s: Callable[[int], float],
                   rows: Callable[[int], int] = lambda k: 1 + k,
                   batches: Sequence[int] = SCHEDULE_BATCHES) -> dict[str, int]:
    """vLLM's ``num_speculative_tokens_per_batch_size``: the draft length :func:`choose_lengths`
    gives a batch of ``b`` like sequences, as inclusive batch-size ranges (``{"1-3": 4, ...}``;
    the last range covers the largest batch measured, and vLLM carries it on to larger ones).
    ``draft_step_s(b)``: one draft depth for ``b`` sequences (drafted together)."""
    chosen = []
    for b in batches:
        per_token = draft_step_s(b) / b  # each sequence's share of a depth drafted for the batch
        ks = choose_lengths([Candidate(acceptance, max_length, per_token, rows)] * b, cost)
        chosen.append((b, round(sum(ks) / len(ks))))
    schedule: dict[str, int] = {}
    start = 1
    for i, (b, k) in enumerate(chosen):
        last = i + 1 == len(chosen)
        if last or chosen[i + 1][1] != k:
            end = b if last else chosen[i + 1][0] - 1
            schedule[f"{start}-{end}"] = k
            start = end + 1
    return schedule
