"""The online tuner's settings (validated, frozen) and its running state with the stopping rules."""
from __future__ import annotations

from dataclasses import dataclass

from search_spaces.errors import SpaceError

__all__ = ["SCORING", "Scoring", "TunerSettings", "TunerState"]


@dataclass(frozen=True)
class Scoring:
    """How candidates are scored on the generated text, shared by a study's tuner and a request's
    controller: ``window`` tokens a score reads, the ``margin`` a switch needs over the current
    strategy, and the ``max_share`` of decode time that scoring may take."""

    window: int = 32  # gamma (SWIFT B.2)
    margin: float = 0.05
    max_share: float = 0.02


SCORING = Scoring()  # the defaults of ``TunerSettings`` and ``ControlSettings``


@dataclass(frozen=True)
class TunerSettings:
    window: int = SCORING.window  # gamma: generated tokens scored per candidate
    # every beta-th sampled trial is proposed by the Bayesian sampler (enqueued seeds do not count)
    beta: int = 2
    max_trials: int = 1000  # S
    patience: int = 300  # stop after this many trials without a new racer
    # stop once the incumbent's matchness reaches this (SWIFT's score threshold); None = never:
    # with a draft model matchness starts near 1, and draft length / threshold still need tuning
    match_threshold: float | None = None
    max_share: float = SCORING.max_share  # tuning time stays below this share of the time decoded so far
    # a candidate joins the race when predicted this much faster than the incumbent on the same window
    switch_margin: float = SCORING.margin
    trials_per_round: int = 4  # at most this many trials before one decode round (budget permitting)
    race_windows: int = 1  # further windows a racer must win before its measured trial ...
    # ... unless scored this much (a share) above the incumbent on the window: then it is measured at
    # once, so the stream runs on a strategy that pays from its first windows (None: never)
    rush_margin: float | None = 0.25
    confirm_tokens: int = 32  # tokens a measured trial decodes before the decision
    # a kept strategy that decoded this many tokens and measured ``switch_margin`` slower than the one
    # it replaced (over everything each decoded) is reverted: a measured trial is one stretch of text
    probation_tokens: int = 128
    # the candidate scored nearest the incumbent (since it took over or the last such measurement) decodes
    # a measured trial when it scored within this share below the incumbent on its window (None: never):
    # before the tuner stops, and once ``stop_windows`` windows passed with no measured trial
    rival_margin: float | None = 0.1
    stop_windows: int = 6  # stop after the incumbent led on this many windows in a row ...
    min_trials: int = 48  # ... and at least this many trials ran (and the allowance is not cut before)
    seed: int = 0
    # a drafting model scores a window only once the allowance covers its forward (the catch-up over
    # text it has not seen, or a plan's pass over the window); free candidates are scored meanwhile
    defer_catch_up: bool = True

    def __post_init__(self) -> None:
        for name in ("window", "beta", "max_trials", "patience", "trials_per_round", "race_windows",
                     "confirm_tokens", "probation_tokens", "stop_windows", "min_trials"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SpaceError(f"tuner setting {name}={value!r} must be a positive integer")
        if self.match_threshold is not None and not 0.0 < self.match_threshold <= 1.0:
            raise SpaceError(f"tuner setting match_threshold={self.match_threshold!r} must be in (0, 1]")
        if isinstance(self.switch_margin, bool) or not isinstance(self.switch_margin, (int, float)) \
                or not 0.0 <= self.switch_margin < 1.0:
            raise SpaceError(f"tuner setting switch_margin={self.switch_margin!r} must be in [0, 1)")
        _optional_share("rush_margin", self.rush_margin, "a share >= 0", float("inf"))
        _optional_share("rival_margin", self.rival_margin, "in [0, 1)", 1.0)
        if not 0.0 < self.max_share <= 1.0:
            raise SpaceError(f"tuner setting max_share={self.max_share!r} must be in (0, 1]")


def _optional_share(name: str, value: object, what: str, below: float) -> None:
    """Raise unless ``value`` is None or a number in [0, ``below``)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not 0.0 <= value < below):
        raise SpaceError(f"tuner setting {name}={value!r} must be {what}, or None")


@dataclass
class TunerState:
    trials: int = 0
    since_improvement: int = 0
    best_score: float = float("-inf")  # the incumbent's score (tokens/s) on the latest window
    best_match: float = 0.0  # and its matchness there
    tuning_s: float = 0.0  # tuning time per window: scoring, trials, races (the allowance's spending)
    calibration_s: float = 0.0  # one-time: timing the cost model while tuning (apart from ``tuning_s``)
    skipped_for_budget: int = 0  # rounds that ran no trial because tuning was over its time share
    windows: int = 0  # windows scored
    stable: int = 0  # windows in a row on which no racer survived (and candidates were tried)
    measured_trials: int = 0
    rival_trials: int = 0  # of them, the incumbent's nearest rival's (``OnlineTuner._measure_rival``)
    measured_at: int = 0  # ``windows`` when the latest measured trial started
    swept: int = 0  # points scored by the sweeps of fresh windows (arithmetic on cached matches)
    flush_s: float = 0.0  # a study's one copy of its trials to the persistent study, after its prompts
    unscored: int = 0  # trials pruned: their drafter could not score the window (not within the allowance)
    done: bool = False
    stop_reason: str = ""
    # stopped because the incumbent kept leading: later windows are still scored (the incumbent and
    # the free families: token arithmetic, a drafting model's forward only within the allowance),
    # and a candidate that beats the incumbent there resumes tuning (the text moved)
    watching: bool = False
    resumed: int = 0  # times a watching tuner resumed
    _tried_at_window: int = 0  # trials + swept points when the latest window was booked

    def after_window(self, joined: bool, settings: TunerSettings) -> None:
        """Book a scored window: the incumbent led on it if candidates were tried since the last
        window and none joined the race (a window without trials, the budget spent, says nothing);
        stop trials, and watch, once it led on ``stop_windows`` windows after ``min_trials``."""
        tried = self.trials + self.swept
        if joined:
            self.stable = 0
        elif tried > self._tried_at_window:
            self.stable += 1
        self._tried_at_window = tried
        if not self.done and self.stable >= settings.stop_windows and self.trials >= settings.min_trials:
            self.done = self.watching = True
            self.stop_reason = f"the incumbent led on {self.stable} windows in a row"

    def measured(self, rival: bool = False) -> None:
        """A measured trial started (``rival``: the incumbent's nearest rival's)."""
        self.measured_trials += 1
        self.rival_trials += rival
        self.measured_at = self.windows

    def unmeasured(self, windows: int) -> bool:
        """Whether a tuner still trying candidates scored ``windows`` windows since its latest
        measured trial started (or since it began): predictions alone have ruled that long."""
        return not self.done and self.windows - self.measured_at >= windows

    def resume(self) -> None:
        """A watching tuner saw a candidate beat the incumbent: the text moved, tuning goes on."""
        self.done, self.watching, self.stop_reason, self.stable = False, False, "", 0
        self.resumed += 1

    def check_limits(self, settings: TunerSettings, speculating: bool) -> None:
        """Stop at ``max_trials``, after ``patience`` trials without a new racer, or once a
        speculating incumbent's matchness reaches ``match_threshold``."""
        if self.done:
            return
        if self.trials >= settings.max_trials:
            self.done, self.stop_reason = True, f"{settings.max_trials} trials"
        elif self.since_improvement >= settings.patience:
            self.done, self.stop_reason = True, f"no new racer in {settings.patience} trials"
        elif settings.match_threshold is not None and speculating and self.best_match >= settings.match_threshold:
            self.done, self.stop_reason = True, f"matchness {self.best_match:.2f} >= {settings.match_threshold}"

    def report(self) -> dict[str, object]:
        """The counters a study reports (``OnlineTuner.summary``)."""
        return {
            "trials": self.trials, "stop_reason": self.stop_reason or "prompts ran out",
            "tuning_s": self.tuning_s, "calibration_s": self.calibration_s,
            "rounds_over_budget": self.skipped_for_budget, "windows": self.windows,
            "measured_trials": self.measured_trials, "rival_trials": self.rival_trials, "swept": self.swept,
            "unscored": self.unscored,
            "resumed": self.resumed, "flush_s": self.flush_s,
        }
