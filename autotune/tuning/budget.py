"""The online tuner's time budget: tuning spends little, so it is safe on live traffic.

Tuning time is an allowance accruing at ``max_share`` of the time that passes while prompts
decode (not between them), divided by 1 + the windows in a row the incumbent has led (re-scoring
less once stable), and tuning spends it (trials wait
until the allowance is positive again, so the share stays at ``max_share``). A lower share later
does not claw back earlier time.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Budget:
    """The tuning-time allowance: accrues at the current share of elapsed decode time, tuning
    spends it."""

    max_share: float
    clock: Callable[[], float]
    allowance: float = 0.0  # seconds of tuning still covered (below zero: spent ahead of accrual)
    accrued_at: float | None = None  # when it last accrued
    paused_at: float | None = None  # end of the last prompt: time between prompts does not accrue

    def accrue(self, now: float, stable: int = 0, sharers: int = 1) -> None:
        """Tuning may use ``max_share`` of the time that passes, divided by 1 + ``stable`` (the
        windows in a row the incumbent has led: re-scoring less once stable) and by ``sharers``
        (the requests of a batch share one decode thread: together they keep to ``max_share``)."""
        if self.accrued_at is not None:
            self.allowance += self.max_share / (1 + stable) / max(sharers, 1) * (now - self.accrued_at)
        self.accrued_at = now

    def covers(self, seconds: float) -> bool:
        """Whether the allowance covers ``seconds`` more of tuning in this round (``max_share=1``
        never stops a trial: tuning is part of the time it shares)."""
        return self.max_share >= 1.0 or self.allowance - seconds > 0

    def spend(self, seconds: float) -> None:
        self.allowance -= seconds

    def pause(self, now: float) -> None:
        """A prompt ended at ``now``: nothing accrues until the next one starts."""
        self.paused_at = now

    def resume(self) -> None:
        """A prompt starts: the allowance is a share of decode time, so the time since the pause
        (an idle server, a study's plain baseline decoding the same prompt) accrues nothing."""
        if self.paused_at is not None and self.accrued_at is not None:
            self.accrued_at += max(0.0, self.clock() - self.paused_at)
        self.paused_at = None
