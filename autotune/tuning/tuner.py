"""The online tuner (SWIFT 4.1), ask-and-tell with Optuna, safe to run on live traffic.

Plain decoding is a point of every space and the incumbent until a candidate beats it on
measured time. While decoding goes on with the incumbent, before rounds the tuner:

1. **Scores candidates** (``trial``): asks the study - first the space's seeds (one reference
   point per drafter kind), then the incumbent's neighbours (``SearchSpace.neighbours``: length
   +-2, threshold +-0.1, enqueued at each window; they reuse the window's matchness, so they cost
   almost nothing), otherwise random search, and every ``beta``-th trial a Bayesian sampler
   (GPSampler, or TPE for conditional spaces) - predicts the candidate's
   tokens/s - matchness on the latest window scored (``window`` tokens; cached until the next
   window, across prompts for the plans scored there) in one forward of its drafting model (or a
   replay of prompt lookup on them), turned into time by the measured cost model, times the
   strategy's correction (below) - and tells the study. A candidate predicted ``switch_margin``
   faster than the incumbent *on the same window* joins the race.
2. **Races** (``_new_window``): each time ``window`` new tokens have been decoded, the incumbent
   and the racers are re-scored on the fresh window; a racer that no longer wins drops out. Then
   the free families are **swept** (``_sweep``): the draft model's all-layer plan (scored by its
   catch-up forward), prompt lookup and the incumbent's plan are scored at every point of their
   grids (``SearchSpace.sweep``: lengths x thresholds x tree heads x ``lookup_first``) -
   arithmetic on the window's cached matches - and the best few predicted ``switch_margin``
   faster join the race. One
   that won on ``race_windows`` further windows decodes for ``confirm_tokens`` tokens (a measured
   trial) and replaces the incumbent only if it measured faster than the incumbent would have on
   the same tokens (plain decoding's measured speed; a speculating incumbent's corrected
   prediction on that window) and than the incumbent's own latest rounds; otherwise decoding
   goes back to the incumbent. A decision needs a prediction that survived fresh data and a
   measurement, so one lucky window never switches. A kept strategy stays on probation: once
   it decoded ``probation_tokens`` and measured more than ``switch_margin`` slower, over
   everything it decoded, than the incumbent it replaced, decoding reverts to that one
   (measured data only, no cost).
3. **Corrects the cost model per strategy**: every measured stretch of a strategy updates its
   correction ``measured / predicted`` tokens/s (its kind's geometric mean serves strategies not
   measured yet), so predictions converge to measurements; ``summary()`` reports the ratio for
   every kept strategy.
4. **Spends little**: tuning time is an allowance accruing at ``max_share`` of the time that
   passes while prompts decode (not between them), divided by 1 + the windows in a row the incumbent has led (re-scoring less
   once stable), and tuning spends it, the cost model's one-time timing included (trials wait
   until the allowance is positive again, so the share stays at ``max_share``); after
   ``stop_windows`` such windows (a sign test at p = 0.5^stop_windows) and ``min_trials`` trials
   it stops. Trials go to an in-memory study (Optuna's RDB writes would cost more than the
   trials) and are copied to the persistent one at the end of each prompt (``flush``).

The decoder switches strategies through ``Decoder.apply``: every drafter kind of the space is on
the decoder (drafting or on standby, following the sequence), so a switch keeps all state.
With ``max_share`` below 1 the trials depend on timings; decisions depend on measured time,
which ``clock`` reads (tests pass a deterministic clock).
"""
from __future__ import annotations

import math
import time
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import optuna
import torch

from autotune.tuning.cost_model import CostModel
from autotune.tuning.matchness import LookupMatch, Match, lookup_match, matchness, score_logits, usable_window
from autotune.tuning.objective import Prediction, predict, predict_lookup, predict_lookup_first, predict_plain
from runtime.decoding import Decoder
from runtime.drafters import ModelDrafter
from runtime.kv_cache import KVCache
from runtime.stats import DecodeStats
from search_spaces.errors import SpaceError
from search_spaces.spaces import SearchSpace, SpaceContext
from search_spaces.strategy import LOOKUP_FIRST_MIN_NGRAM, PLAIN, Strategy


@dataclass(frozen=True)
class TunerSettings:
    window: int = 32  # gamma: generated tokens scored per candidate (SWIFT B.2)
    beta: int = 10  # every beta-th trial is proposed by the Bayesian sampler
    max_trials: int = 1000  # S
    patience: int = 300  # stop after this many trials without a new racer
    # stop once the incumbent's matchness reaches this (SWIFT's score threshold); None = never:
    # with a draft model matchness starts near 1, and draft length / threshold still need tuning
    match_threshold: float | None = None
    max_share: float = 0.02  # tuning time stays below this share of the time decoded so far
    # a candidate joins the race when predicted this much faster than the incumbent on the same window
    switch_margin: float = 0.05
    trials_per_round: int = 4  # at most this many trials before one decode round (budget permitting)
    trials_per_window: int = 8  # trials on a window before a fresh one is scored (unless racers wait)
    race_windows: int = 1  # further windows a racer must win before its measured trial
    confirm_tokens: int = 32  # tokens a measured trial decodes before the decision
    # a kept strategy that decoded this many tokens and measured ``switch_margin`` slower than the one
    # it replaced (over everything each decoded) is reverted: a measured trial is one stretch of text
    probation_tokens: int = 128
    stop_windows: int = 6  # stop after the incumbent led on this many windows in a row ...
    min_trials: int = 24  # ... and at least this many trials ran
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("window", "beta", "max_trials", "patience", "trials_per_round", "trials_per_window", "race_windows",
                     "confirm_tokens", "probation_tokens", "stop_windows", "min_trials"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SpaceError(f"tuner setting {name}={value!r} must be a positive integer")
        if self.match_threshold is not None and not 0.0 < self.match_threshold <= 1.0:
            raise SpaceError(f"tuner setting match_threshold={self.match_threshold!r} must be in (0, 1]")
        if isinstance(self.switch_margin, bool) or not isinstance(self.switch_margin, (int, float)) \
                or not 0.0 <= self.switch_margin < 1.0:
            raise SpaceError(f"tuner setting switch_margin={self.switch_margin!r} must be in [0, 1)")
        if not 0.0 < self.max_share <= 1.0:
            raise SpaceError(f"tuner setting max_share={self.max_share!r} must be in (0, 1]")


LOOKUP_FIRST_KEY = ("lookup-first", None)  # window cache: the n-gram replay of `lookup_first` drafts
RACE_SIZE = 4  # racers kept (the best predicted)
RECENT_ROUNDS = 48  # an incumbent's measured speed: its latest rounds (the context grows as it decodes)


@dataclass
class Kept:
    """A strategy that decoded: its prediction and what decoding with it measured."""

    strategy: Strategy
    trial: int
    predicted_tps: float  # corrected prediction when it was chosen
    matchness: float
    tokens: int = 0
    seconds: float = 0.0
    drafted: int = 0  # draft tokens it verified, and how many of them were accepted
    accepted: int = 0
    raw_tps: float = 0.0  # its uncorrected prediction on the latest window it was scored on
    raws: list[float] = field(default_factory=list)  # uncorrected predictions on the windows it raced / decoded
    bar_tps: float | None = None  # a measured trial's bar: the incumbent's speed on the same tokens
    replaced: "Kept | None" = None  # the incumbent it replaced (what its probation compares with)
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT_ROUNDS))  # (tokens, seconds) per round

    @property
    def measured_tps(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def recent_tps(self) -> float | None:
        n, s = sum(t for t, _ in self.recent), sum(s for _, s in self.recent)
        return n / s if s > 0 else None


@dataclass
class Racer:
    """A candidate that beat the incumbent on a window; it must keep winning on fresh ones."""

    strategy: Strategy
    trial: int
    score: float
    raw: float
    matchness: float
    wins: int = 0  # fresh windows won since it joined
    raws: list[float] = field(default_factory=list)  # its uncorrected predictions, one per window


@dataclass
class TunerState:
    trials: int = 0
    since_improvement: int = 0
    best_score: float = float("-inf")  # the incumbent's score (tokens/s) on the latest window
    best_match: float = 0.0  # and its matchness there
    tuning_s: float = 0.0  # all tuning time, the cost model's timing included
    calibration_s: float = 0.0  # of which timing the cost model (once per study)
    skipped_for_budget: int = 0  # rounds that ran no trial because tuning was over its time share
    windows: int = 0  # windows scored
    stable: int = 0  # windows in a row on which no racer survived (and candidates were tried)
    measured_trials: int = 0
    swept: int = 0  # points scored by the sweeps of fresh windows (arithmetic on cached matches)
    done: bool = False
    stop_reason: str = ""


def bayesian_sampler(space: SearchSpace, seed: int) -> optuna.samplers.BaseSampler:
    """GPSampler for flat spaces; TPE (multivariate, grouped) where parameters are conditional."""
    if space.conditional:
        with warnings.catch_warnings():  # `multivariate`/`group` are marked experimental by Optuna
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True)
    return optuna.samplers.GPSampler(seed=seed)


Scorer = Callable[["OnlineTuner", Decoder, Strategy, list[int]], "tuple[Prediction, float] | None"]


def _score_plain(tuner: "OnlineTuner", decoder: Decoder, strategy: Strategy, tokens: list[int]) -> tuple[Prediction, float]:
    return predict_plain(tuner.cost), 0.0


def _score_model(tuner: "OnlineTuner", decoder: Decoder, strategy: Strategy, tokens: list[int]) -> tuple[Prediction, float] | None:
    """A drafting model (a draft model, or the target skipping layers): matchness of its plan on
    the window, in one forward (cached per plan and window)."""
    drafter = decoder.drafter_of(strategy.drafter)
    if not isinstance(drafter, ModelDrafter):
        return None
    window = tuner.settings.window
    plan = strategy.layer_plan
    identity = plan is None or plan.is_identity
    key = (strategy.drafter, None if identity else plan)
    match = tuner.window_cache.get(key)
    if match is None and tuner.stale_window(tokens):  # an earlier prompt's: the cache holds another sequence
        return None
    if match is None:
        if identity:  # on standby: its catch-up forward scores the window too
            logits = drafter.sync_scoring(tokens, window)
            if logits is not None:
                w = logits.shape[0]
                match = tuner.window_cache[key] = score_logits(logits, torch.tensor(tokens[len(tokens) - w:]))
    if match is None:
        if not usable_window(len(tokens), drafter.cache.length, window):
            drafter.sync()  # on standby: its cache lags by the tokens decoded without it
            if not usable_window(len(tokens), drafter.cache.length, window):
                return None
        match = tuner.window_cache[key] = matchness(drafter.model, drafter.cache, strategy.layer_plan, tokens, window)
    horizon = tuner.ctx.max_draft_length
    if strategy.lookup_first:  # rounds where an n-gram recurs copy it; the model drafts the rest
        copies = tuner.window_cache.get(LOOKUP_FIRST_KEY)
        if copies is None:
            copies = tuner.window_cache[LOOKUP_FIRST_KEY] = lookup_match(tokens, window, horizon, LOOKUP_FIRST_MIN_NGRAM)
        assert isinstance(match, Match) and isinstance(copies, LookupMatch)
        return predict_lookup_first(strategy, match, copies, tuner.cost, horizon), match.rate
    return predict(strategy, match, tuner.cost, horizon), match.rate


def _score_lookup(tuner: "OnlineTuner", decoder: Decoder, strategy: Strategy, tokens: list[int]) -> tuple[Prediction, float]:
    key = ("prompt-lookup", None)
    match = tuner.window_cache.get(key)
    if match is None:
        match = tuner.window_cache[key] = lookup_match(tokens, tuner.settings.window, tuner.ctx.max_draft_length)
    assert isinstance(match, LookupMatch)
    return predict_lookup(strategy, match, tuner.cost, tuner.ctx.max_draft_length), match.rate


# drafter kind -> how a strategy of that kind is scored on the current window
SCORERS: dict[str, Scorer] = {
    "none": _score_plain,
    "draft-model": _score_model,
    "layer-skip": _score_model,
    "prompt-lookup": _score_lookup,
}


class OnlineTuner:
    def __init__(
        self,
        space: SearchSpace,
        ctx: SpaceContext,
        study: optuna.Study,
        cost: CostModel,
        settings: TunerSettings,
        initial: Strategy = PLAIN,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """``study``: where trials are kept (``flush`` copies them there; an in-memory working
        study takes them while decoding). ``initial``: a strategy to try first (e.g. a resumed
        study's best): it is enqueued and must win its race like any candidate; decoding starts
        plain."""
        self.space, self.ctx, self.cost, self.settings, self.clock = space, ctx, cost, settings, clock
        self.persistent = study
        self._flushed = 0
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=settings.seed))
        if study.trials:  # resumed: the sampler learns from the earlier trials too
            self.study.add_trials([t for t in study.trials if t.state.is_finished()])
            self._flushed = len(self.study.trials)
        self.random = optuna.samplers.RandomSampler(seed=settings.seed)
        self.bayes = bayesian_sampler(space, settings.seed)
        self.state = TunerState()
        self.incumbent = Kept(PLAIN, trial=-1, predicted_tps=0.0, matchness=0.0)
        self.kept: list[Kept] = [self.incumbent]
        self.challenger: Kept | None = None  # a racer decoding for its measured trial
        self.race: dict[Strategy, Racer] = {}
        self.switches: list[int] = []  # trial numbers of the strategies that replaced the incumbent
        self.rejected: list[Kept] = []  # measured trials that lost to the incumbent
        self.reverted: list[Kept] = []  # kept strategies that then measured slower than what they replaced
        self.corrections: dict[Strategy, float] = {}
        self.window_cache: dict[Any, Match | LookupMatch] = {}  # (kind, plan) -> its match on the window
        self._cache_for: list[int] = []  # the tokens the cached matches were scored on
        self._window_at = 0  # sequence length of the latest window scored
        # the tokens of the latest window scored (maybe of an earlier prompt): trials score there;
        # ``_stale`` once another prompt began (only plans already scored there can be scored)
        self._scored: list[int] = []
        self._stale = True
        self._trials_at_window = 0  # trials run before the latest window
        self._asked_at_window = 0  # trials asked on the latest window (failed ones included)
        # at the last round: tokens, forwards, draft rounds, verify_s, clock, drafted, accepted
        self._last: tuple[int, int, int, float, float, int, int] | None = None
        self._prompt_start = 0
        self._applied = False
        # tuning-time allowance: accrues at the current share of elapsed time, tuning spends it (the
        # cost model's one-time timing too); a lower share later does not claw back earlier time
        self._allowance = 0.0
        self._accrued_at: float | None = None
        self._paused_at: float | None = None  # end of the last prompt: time between prompts does not accrue
        # tried first: a resumed study's best, then the space's seeds (one good point per drafter kind)
        seeds = [initial] + [s for s in space.seeds(ctx) if s != initial]
        self._queued: set[Strategy] = set()  # strategies enqueued so far (seeds, neighbours)
        for seed in seeds:
            self._enqueue(seed)
        # seeds whose score on a fresh window costs no forward of their own (prompt lookup; a
        # draft's all-layer plan, scored by its catch-up forward): their families (``sweep``) are
        # scored on every fresh window, so one unrepresentative window does not rule a kind of
        # drafter out, and lengths, thresholds and tree heads are compared where it costs nothing
        self._free = [s for s in seeds if s.speculates and (s.layer_plan is None or s.layer_plan.is_identity)]
        self._families: dict[tuple[str, Any], list[Strategy]] = {}  # (drafter, plan) -> its sweep grid

    # ----------------------------------------------------------------- decode hooks
    @property
    def running(self) -> Kept:
        return self.challenger or self.incumbent

    def stale_window(self, tokens: list[int]) -> bool:
        """Whether ``tokens`` is the latest window scored and it belongs to an earlier prompt
        (then only plans already scored there can be scored)."""
        return self._stale and tokens is self._scored

    def start_prompt(self, prompt_len: int) -> None:
        self._prompt_start = prompt_len
        self._window_at = prompt_len
        self._last = None
        self._stale = True  # the drafters' caches now hold another sequence
        if self._paused_at is not None and self._accrued_at is not None:
            # the allowance is a share of decode time: time between prompts (an idle server, a
            # study's plain baseline decoding the same prompt) accrues nothing
            self._accrued_at += max(0.0, self.clock() - self._paused_at)
        self._paused_at = None

    def end_prompt(self, tokens: list[int], stats: DecodeStats) -> None:
        """Attribute the prompt's last round to the running strategy, refresh the incumbent's
        correction with it (what it is predicted to do is what it measured so far); persist the
        new trials."""
        self._account(tokens, stats)
        self._last = None
        self._correct(self.incumbent)
        t0 = self.clock()
        self.flush()
        self._paused_at = now = self.clock()
        spent = now - t0
        self.state.tuning_s += spent
        self._allowance -= spent

    def before_round(self, decoder: Decoder, tokens: list[int], cache: KVCache, stats: DecodeStats) -> None:
        self._account(tokens, stats)
        self._probation(decoder)
        t0 = self.clock()
        self._accrue(t0)
        if not self._applied:  # plain decoding until a candidate beats it on measured time
            decoder.apply(self.incumbent.strategy)
            self._applied = True
        try:
            ch = self.challenger
            if ch is not None and ch.tokens >= self.settings.confirm_tokens:
                self._decide(decoder, tokens)
            if self.challenger is not None or len(tokens) - self._prompt_start < self.settings.window:
                return
            if self.state.done and not self.race:  # stopped, and no racer left to decide
                return
            if not self._within_budget(t0, 0.0):
                self.state.skipped_for_budget += 1
                return
            if self._wants_window(tokens):
                self._new_window(decoder, tokens)
            if self.state.done or not self._scored:
                return
            # trials score on the latest window scored (its matches are cached until the next one,
            # across prompts too), so between windows a candidate whose plan was scored there costs
            # no forward
            for _ in range(self.settings.trials_per_round):
                if self.state.done or self.challenger is not None or not self._trial(decoder, self._scored) \
                        or not self._within_budget(t0, self.clock() - t0):
                    break
        finally:
            spent = self.clock() - t0
            self.state.tuning_s += spent
            # timing the cost model is part of the share like trials are: held against the
            # allowance (later trials wait for it), reported apart
            self.state.calibration_s = getattr(self.cost, "calibration_s", 0.0)
            self._allowance -= spent
            if self._last is not None:  # tuning time is not decode time of the running strategy
                self._last = (*self._last[:4], self._last[4] + spent, *self._last[5:])

    def _wants_window(self, tokens: list[int]) -> bool:
        """A fresh window is scored (one forward per plan) when ``window`` new tokens are there
        and it decides something: racers to re-score, no window yet, or ``trials_per_window``
        trials asked on the latest one (failed ones too: a plan not scored on an earlier prompt's
        window fails there). Otherwise the allowance goes to trials on the cached window."""
        if len(tokens) - self._window_at < self.settings.window:
            return False
        return bool(self.race) or not self._scored or self._asked_at_window >= self.settings.trials_per_window

    def _accrue(self, now: float) -> None:
        """Tuning may use ``max_share`` of the time that passes, divided by 1 + the windows in a
        row the incumbent has led (re-scoring less once stable)."""
        if self._accrued_at is not None:
            self._allowance += self.settings.max_share / (1 + self.state.stable) * (now - self._accrued_at)
        self._accrued_at = now

    def _within_budget(self, t0: float, spent_now: float) -> bool:
        """Whether the allowance covers ``spent_now`` more seconds of tuning in this round
        (``max_share=1`` never stops a trial: tuning is part of the time it shares)."""
        return self.settings.max_share >= 1.0 or self._allowance - spent_now > 0

    def _account(self, tokens: list[int], stats: DecodeStats) -> None:
        """Attribute the round just decoded to the running strategy and refresh the cost model
        with its target step (a verify at the fixed width when it drafted, else a plain step)."""
        now = self.clock()
        if self._last is not None:
            n, forwards, rounds, verify, clock, drafted, accepted = self._last
            new, secs = len(tokens) - n, now - clock
            run = self.running
            run.tokens += new
            run.seconds += secs
            run.drafted += stats.drafted - drafted
            run.accepted += stats.accepted - accepted
            if new > 0:
                run.recent.append((new, secs))
            steps = stats.target_forwards - forwards
            if steps > 0 and stats.verify_s > verify:
                observe = self.cost.observe_verify if stats.draft_rounds > rounds else self.cost.observe_plain
                observe((stats.verify_s - verify) / steps)
        self._last = (len(tokens), stats.target_forwards, stats.draft_rounds, stats.verify_s, now,
                      stats.drafted, stats.accepted)

    # ----------------------------------------------------------------- scoring
    def score(self, decoder: Decoder, strategy: Strategy, tokens: list[int]) -> tuple[float, float, float] | None:
        """-> (corrected tokens/s, raw predicted tokens/s, matchness) of ``strategy`` on the
        latest window, or None when its drafter cannot score there."""
        if self._cache_for != tokens:  # another window (or sequence): nothing of it scored yet
            self.window_cache, self._cache_for = {}, list(tokens)
        got = SCORERS[strategy.drafter](self, decoder, strategy, tokens)
        if got is None:
            return None
        prediction, rate = got
        raw = prediction.tokens_per_s
        return raw * self.correction(strategy), raw, rate

    def correction(self, strategy: Strategy) -> float:
        """Measured / predicted tokens/s of ``strategy``; for one never measured, the geometric
        mean over measured strategies of its drafter kind (1 when there are none)."""
        if strategy in self.corrections:
            return self.corrections[strategy]
        same = [c for s, c in self.corrections.items() if s.drafter == strategy.drafter]
        return math.exp(sum(math.log(c) for c in same) / len(same)) if same else 1.0

    def _correct(self, kept: Kept) -> None:
        """The strategy's correction: its measured tokens/s over everything it decoded, divided by
        the mean of its uncorrected predictions on the windows it raced and decoded (a ratio of
        averages: one window's prediction swings with the text, e.g. prompt lookup on copied code)."""
        measured = kept.measured_tps
        if measured is None or not kept.raws or not kept.strategy.speculates:
            return  # plain decoding's prediction is a measurement already
        mean = sum(kept.raws) / len(kept.raws)
        if mean > 0:
            self.corrections[kept.strategy] = measured / mean

    def _incumbent_score(self, decoder: Decoder, tokens: list[int]) -> float | None:
        """The incumbent's score on the latest window: plain decoding's measured speed (its
        prediction before any plain round), a speculating incumbent's corrected prediction."""
        inc = self.incumbent
        if not inc.strategy.speculates:
            score = inc.recent_tps or predict_plain(self.cost).tokens_per_s
            inc.predicted_tps = inc.predicted_tps or score
            self.state.best_score, self.state.best_match = score, 0.0
            return score
        got = self.score(decoder, inc.strategy, tokens)
        if got is None:
            return None
        score, inc.raw_tps, rate = got
        self.state.best_score, self.state.best_match = score, rate
        return score

    # ----------------------------------------------------------------- racing
    def _new_window(self, decoder: Decoder, tokens: list[int]) -> None:
        """Fresh tokens: correct the incumbent from its measured stretch, re-score it and the
        racers; start a measured trial for the best racer that kept winning."""
        state = self.state
        inc = self.incumbent
        self._correct(inc)
        incumbent = self._incumbent_score(decoder, tokens)
        if incumbent is None:
            return
        if inc.strategy.speculates:
            inc.raws.append(inc.raw_tps)
        self._window_at = len(tokens)
        self._scored, self._stale = list(tokens), False
        state.windows += 1
        survivors = []
        for racer in list(self.race.values()):
            got = self.score(decoder, racer.strategy, tokens)
            if got is None or got[0] <= incumbent * (1.0 + self.settings.switch_margin):
                del self.race[racer.strategy]
                continue
            racer.score, racer.raw, racer.matchness = got
            racer.raws.append(racer.raw)
            racer.wins += 1
            survivors.append(racer)
        ready = [r for r in survivors if r.wins >= self.settings.race_windows]
        if ready:
            self._measure(decoder, max(ready, key=lambda r: r.score))
        if not state.done:  # a stopped tuner only finishes its race
            survivors += self._sweep(decoder, tokens, incumbent)
        for near in self.space.neighbours(inc.strategy, self.ctx):  # a local step around the incumbent
            self._enqueue(near)
        # the incumbent led on this window if candidates were tried since the last one and none
        # survived (a window without trials - the budget spent - says nothing)
        tried = state.trials + state.swept
        if survivors:
            state.stable = 0
        elif tried > self._trials_at_window:
            state.stable += 1
        self._trials_at_window = tried
        self._asked_at_window = 0
        if state.stable >= self.settings.stop_windows and state.trials >= self.settings.min_trials:
            state.done = True
            state.stop_reason = f"the incumbent led on {state.stable} windows in a row"
        self._maybe_stop()

    def family(self, strategy: Strategy) -> list[Strategy]:
        """``strategy``'s sweep grid (``SearchSpace.sweep``), built once per drafter and plan."""
        plan = strategy.layer_plan
        key = (strategy.drafter, None if plan is None or plan.is_identity else plan)
        if key not in self._families:
            self._families[key] = self.space.sweep(strategy, self.ctx)
        return self._families[key]

    def _sweep(self, decoder: Decoder, tokens: list[int], incumbent: float) -> list[Racer]:
        """Score the free families (the seeds' whose plans cost no forward of their own, and the
        incumbent's, scored on this window anyway) at every point of their grids; the best few
        predicted ``switch_margin`` above the incumbent join the race, each told to the study as a
        trial (sampler ``sweep``). -> the racers that joined."""
        running = {self.incumbent.strategy} | ({self.challenger.strategy} if self.challenger else set())
        points: dict[Strategy, None] = dict.fromkeys(self._free)  # the seeds too (a cut tree is off the grid)
        for base in [*self._free, self.incumbent.strategy]:
            points.update(dict.fromkeys(self.family(base)))
        scored = []
        for s in points:
            if s in self.race or s in running:
                continue
            got = self.score(decoder, s, tokens)
            if got is None:
                continue
            self.state.swept += 1
            if got[0] > incumbent * (1.0 + self.settings.switch_margin):
                scored.append((got, s))
        joined = []
        # ties go to the longer draft (at one verify width, no slower where predictions agree)
        for (score, raw, rate), s in sorted(scored, key=lambda x: (-x[0][0], -x[1].draft_length))[:RACE_SIZE]:
            trial = self._tell_swept(s, score, raw, rate)
            if self._join_race(s, trial, score, raw, rate, incumbent) and s in self.race:
                self.state.since_improvement = 0
                joined.append(self.race[s])
        return joined

    def _tell_swept(self, strategy: Strategy, score: float, raw: float, rate: float) -> int:
        """Record a swept point as a finished trial of the working study (-> its number)."""
        params, distributions = self.space.encode_trial(strategy, self.ctx)
        self.study.add_trial(optuna.trial.create_trial(
            params=params, distributions=distributions, value=score,
            user_attrs={"sampler": "sweep", "drafter": strategy.drafter, "matchness": rate, "raw_tps": raw},
        ))
        self.state.trials += 1
        return len(self.study.get_trials(deepcopy=False)) - 1

    def _enqueue(self, strategy: Strategy) -> None:
        if strategy.speculates and strategy not in self._queued:
            self._queued.add(strategy)
            self.study.enqueue_trial(self.space.encode(strategy, self.ctx))

    def _measure(self, decoder: Decoder, racer: Racer) -> None:
        del self.race[racer.strategy]
        self.challenger = Kept(racer.strategy, racer.trial, racer.score, racer.matchness, raw_tps=racer.raw,
                               raws=list(racer.raws))
        self.state.measured_trials += 1
        decoder.apply(racer.strategy)

    def _decide(self, decoder: Decoder, tokens: list[int]) -> None:
        """End a measured trial: the challenger replaces the incumbent if it decoded faster than
        the incumbent would have on the same tokens - plain decoding's measured speed, or a
        speculating incumbent's corrected prediction on the window the challenger just decoded -
        and than the incumbent's own measured speed over its latest rounds; otherwise decoding
        goes back to the incumbent."""
        ch, inc = self.challenger, self.incumbent
        assert ch is not None
        self.challenger = None
        self._correct(ch)
        same_text = None
        if inc.strategy.speculates:
            same_text = self._incumbent_score(decoder, tokens)
            self._window_at = len(tokens)  # the window just scored is the latest (trials reuse its matches)
            self._scored, self._stale = list(tokens), False
        # and not slower than the incumbent measured lately: how fast a drafter goes depends on
        # the text (prompt lookup flies where a completion copies its prompt), so a switch must
        # win on the same text and against what the incumbent has been doing
        bar = max(same_text or 0.0, inc.recent_tps or inc.predicted_tps)
        ch.bar_tps = bar
        if (ch.measured_tps or 0.0) > bar:
            ch.replaced = inc
            self.incumbent = ch
            self.kept.append(ch)
            self.switches.append(ch.trial)
            self.state.since_improvement = 0
            self.state.stable = 0
        else:
            self.rejected.append(ch)
            decoder.apply(inc.strategy)

    def _probation(self, decoder: Decoder) -> None:
        """Revert a kept strategy that, over ``probation_tokens`` or more, measured more than
        ``switch_margin`` slower than the incumbent it replaced (measured data only: costs
        nothing). The two speeds come from different stretches of text, so a smaller gap is
        noise, not a verdict: the kept strategy won its measured trial on the same tokens."""
        inc = self.incumbent
        prev = inc.replaced
        if prev is None or self.challenger is not None or inc.tokens < self.settings.probation_tokens:
            return
        if (inc.measured_tps or 0.0) >= (prev.measured_tps or 0.0) * (1.0 - self.settings.switch_margin):
            return
        inc.bar_tps = prev.measured_tps
        self.reverted.append(inc)
        self.incumbent = prev
        self.switches.append(prev.trial)
        self.state.stable = 0
        decoder.apply(prev.strategy)

    # ----------------------------------------------------------------- one trial
    def _trial(self, decoder: Decoder, tokens: list[int]) -> bool:
        state = self.state
        incumbent = self._incumbent_score(decoder, tokens)
        if incumbent is None:
            return False
        use_bayes = (state.trials + 1) % self.settings.beta == 0
        self.study.sampler = self.bayes if use_bayes else self.random
        with torch.enable_grad():  # GP fitting needs autograd
            trial = self.study.ask()
        self._asked_at_window += 1
        enqueued = "fixed_params" in self.study._storage.get_trial_system_attrs(trial._trial_id)
        try:
            strategy = self.space.define(trial, self.ctx)
            got = self.score(decoder, strategy, tokens)
        except BaseException:  # Ctrl-C included: the trial is closed as failed, not left running
            self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
            raise
        if got is None:  # its drafter cannot score this window (yet)
            self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
            return False
        score, raw, rate = got
        trial.set_user_attr("sampler", "enqueued" if enqueued else ("bayes" if use_bayes else "random"))
        trial.set_user_attr("drafter", strategy.drafter)
        trial.set_user_attr("matchness", rate)
        trial.set_user_attr("raw_tps", raw)
        self.study.tell(trial, score)
        state.trials += 1
        state.since_improvement += 1
        if self._join_race(strategy, trial.number, score, raw, rate, incumbent):
            state.since_improvement = 0
        self._maybe_stop()
        return not state.done

    def _join_race(self, strategy: Strategy, trial: int, score: float, raw: float, rate: float,
                   incumbent: float) -> bool:
        """Enter ``strategy`` in the race when it scored ``switch_margin`` above the incumbent."""
        running = {self.incumbent.strategy} | ({self.challenger.strategy} if self.challenger else set())
        if strategy in running or score <= incumbent * (1.0 + self.settings.switch_margin):
            return False
        racer = self.race.get(strategy)
        if racer is None:
            self.race[strategy] = Racer(strategy, trial, score, raw, rate, raws=[raw])
        elif score > racer.score:
            racer.trial, racer.score, racer.raw, racer.matchness = trial, score, raw, rate
        if len(self.race) > RACE_SIZE:  # keep the best few
            worst = min(self.race.values(), key=lambda r: r.score)
            del self.race[worst.strategy]
        return True

    def _maybe_stop(self) -> None:
        s, cfg = self.state, self.settings
        if s.done:
            return
        if s.trials >= cfg.max_trials:
            s.done, s.stop_reason = True, f"{cfg.max_trials} trials"
        elif s.since_improvement >= cfg.patience:
            s.done, s.stop_reason = True, f"no new racer in {cfg.patience} trials"
        elif cfg.match_threshold is not None and self.incumbent.strategy.speculates and s.best_match >= cfg.match_threshold:
            s.done, s.stop_reason = True, f"matchness {s.best_match:.2f} >= {cfg.match_threshold}"

    # ----------------------------------------------------------------- results
    @property
    def best(self) -> Strategy:
        return self.incumbent.strategy

    def predicted_tps(self, strategy: Strategy) -> float | None:
        """A kept strategy's corrected prediction for the task: the mean of its uncorrected
        predictions on the windows it decoded, times its correction (plain: its measured speed)."""
        for k in reversed(self.kept):
            if k.strategy == strategy:
                if not strategy.speculates:
                    return k.recent_tps or k.predicted_tps
                if not k.raws:
                    return k.predicted_tps
                return sum(k.raws) / len(k.raws) * self.correction(strategy)
        return None

    def flush(self) -> None:
        """Copy the trials finished since the last flush into the persistent study."""
        done = [t for t in self.study.get_trials(deepcopy=False)[self._flushed:]]
        finished = []
        for t in done:
            if not t.state.is_finished():
                break
            finished.append(t)
        if finished and self.persistent is not self.study:
            self.persistent.add_trials(finished)
        self._flushed += len(finished)

    def summary(self) -> dict[str, Any]:
        plain_s = self.cost.plain_step_s()
        kept = []
        for k in self.kept:
            predicted = self.predicted_tps(k.strategy) if k is self.incumbent else k.predicted_tps
            measured = k.measured_tps
            kept.append({
                "trial": k.trial, "strategy": k.strategy.to_dict(), "predicted_tps": predicted,
                "measured_tps": measured, "matchness": k.matchness, "tokens": k.tokens, "acceptance": k.acceptance,
                "bar_tps": k.bar_tps,
                "ratio": predicted / measured if predicted and measured else None,
            })
        return {
            "plain_predicted_tps": 1.0 / plain_s if plain_s > 0 else None,
            "trials": self.state.trials,
            "stop_reason": self.state.stop_reason or "prompts ran out",
            "best_predicted_tps": self.predicted_tps(self.incumbent.strategy) or 0.0,
            "best_matchness": self.incumbent.matchness,
            "tuning_s": self.state.tuning_s,
            "calibration_s": self.state.calibration_s,
            "rounds_over_budget": self.state.skipped_for_budget,
            "windows": self.state.windows,
            "measured_trials": self.state.measured_trials,
            "swept": self.state.swept,
            "rejected": [
                {"trial": k.trial, "strategy": k.strategy.to_dict(), "predicted_tps": k.predicted_tps,
                 "measured_tps": k.measured_tps, "incumbent_tps": k.bar_tps}
                for k in self.rejected
            ],
            "switches": list(self.switches),
            "reverted": [
                {"trial": k.trial, "strategy": k.strategy.to_dict(), "measured_tps": k.measured_tps,
                 "replaced_tps": k.bar_tps, "tokens": k.tokens}
                for k in self.reverted
            ],
            "kept": kept,
        }
