"""Measured / predicted tokens/s: the one correction scheme of the online tuner's race and the
per-request controller.

Each measured stretch of a strategy (its tokens, their seconds, and the uncorrected predictions
made for it on the windows it raced or decoded) adds to that strategy's evidence. Its factor is a
ratio of averages: measured tokens/s over all its evidence, divided by the mean of its
predictions (one window's prediction swings with the text; the mean over many does not). A
strategy not measured yet takes the geometric mean of its drafter kind's factors (1 when there
are none). Evidence past ``memory_tokens`` decays in proportion, so a server's factors follow its
machine's load; every factor stays within ``CORRECTION_RANGE``.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from search_spaces.strategy import Strategy

CORRECTION_RANGE = (0.25, 4.0)  # a factor never leaves this range (one odd stretch must not price a kind out)
MEMORY_TOKENS = 4096  # a strategy's evidence is scaled down to this many measured tokens as more arrives


@dataclass
class Evidence:
    """What one strategy decoded and what was predicted for it."""

    tokens: float = 0.0
    seconds: float = 0.0
    predicted_sum: float = 0.0  # uncorrected predictions (tokens/s), summed
    predictions: float = 0.0  # how many

    @property
    def ratio(self) -> float | None:
        if self.seconds <= 0 or self.predictions <= 0 or self.predicted_sum <= 0:
            return None
        return (self.tokens / self.seconds) / (self.predicted_sum / self.predictions)


def _clamped(ratio: float) -> float:
    lo, hi = CORRECTION_RANGE
    return min(max(ratio, lo), hi)


class Corrections:
    """Per-strategy factors (measured / predicted tokens/s), learnt from decoding. A server's
    requests share one; a tuner has its own. It also keeps what scoring a drafting model last
    cost (``model_s``), for a controller's first score of one."""

    def __init__(self, memory_tokens: int = MEMORY_TOKENS) -> None:
        if memory_tokens < 1:
            raise ValueError(f"memory_tokens={memory_tokens} must be at least 1")
        self.memory_tokens = memory_tokens
        self.evidence: dict[Strategy, Evidence] = {}
        self.model_s: float | None = None

    def observe(self, strategy: Strategy, predicted: float | Sequence[float], tokens: int, seconds: float) -> None:
        """``strategy`` decoded ``tokens`` in ``seconds``, predicted (uncorrected) at ``predicted``
        tokens/s - one prediction, or one per window it raced and decoded. Plain decoding's
        prediction is a measurement already: it keeps no factor."""
        preds = [predicted] if isinstance(predicted, (int, float)) else list(predicted)
        preds = [p for p in preds if p > 0]
        if not strategy.speculates or tokens <= 0 or seconds <= 0 or not preds:
            return
        ev = self.evidence.setdefault(strategy, Evidence())
        ev.tokens += tokens
        ev.seconds += seconds
        ev.predicted_sum += sum(preds)
        ev.predictions += len(preds)
        if ev.tokens > self.memory_tokens:
            keep = self.memory_tokens / ev.tokens
            ev.tokens, ev.seconds = ev.tokens * keep, ev.seconds * keep
            ev.predicted_sum, ev.predictions = ev.predicted_sum * keep, ev.predictions * keep

    def factor(self, strategy: Strategy) -> float:
        """Measured / predicted tokens/s for ``strategy``: its own, else its kind's geometric mean, else 1."""
        measured = self.measured(strategy) if strategy.speculates else None
        return 1.0 if measured is None else measured

    def measured(self, strategy: Strategy) -> float | None:
        """``factor`` where evidence backs it (``strategy``'s own, else its drafter kind's geometric
        mean); None where nothing of its drafter kind was measured."""
        own = self.evidence.get(strategy)
        if own is not None and own.ratio is not None:
            return _clamped(own.ratio)
        same = [_clamped(r) for s, ev in self.evidence.items() if s.drafter == strategy.drafter
                and (r := ev.ratio) is not None]
        return math.exp(sum(math.log(c) for c in same) / len(same)) if same else None


class KindCorrections:
    """One kind of traffic's view of a server's corrections (a route, or a pending cluster of
    unknown requests): its own evidence first, the server's beside it.

    Prompt lookup predicted from a window of code repeats what the code repeats; on chat or maths
    text one window's repeats promise more than the next windows hold, so one factor per strategy
    for every kind of text prices lookup for chat with code's evidence. ``factor`` is this kind's
    own factor for the strategy, else its own drafter kind's mean, else the server's factor capped
    at 1: a kind with no evidence of its own takes what other kinds measured below their predictions
    (the machine's costs), never what they measured above them (their text's long repeats), so its
    first switch is priced by its own window alone. ``observe`` adds to both. What scoring a
    drafting model cost (``model_s``) is the server's."""

    def __init__(self, shared: Corrections, own: Corrections | None = None) -> None:
        self.shared = shared
        self.own = own if own is not None else Corrections(shared.memory_tokens)

    @property
    def model_s(self) -> float | None:
        return self.shared.model_s

    @model_s.setter
    def model_s(self, value: float | None) -> None:
        self.shared.model_s = value

    def observe(self, strategy: Strategy, predicted: float | Sequence[float], tokens: int, seconds: float) -> None:
        self.own.observe(strategy, predicted, tokens, seconds)
        self.shared.observe(strategy, predicted, tokens, seconds)

    def factor(self, strategy: Strategy) -> float:
        if not strategy.speculates:
            return 1.0
        own = self.own.measured(strategy)
        return own if own is not None else min(self.shared.factor(strategy), 1.0)
