"""The online tuner (SWIFT 4.1), ask-and-tell with Optuna.

Decoding starts with the space's untuned reference strategy. Once ``window`` tokens have been
generated, before every decode round the tuner asks the study for a candidate (random search,
and every ``beta``-th trial a Bayesian sampler: GPSampler, or TPE for conditional spaces),
scores it - matchness on the last ``window`` tokens in one draft forward, turned into predicted
tokens/s by the measured cost model - tells the study, and switches the decoder to it when it
is predicted ``switch_margin`` faster than the incumbent scored on the same window (a score from
one short window is noisy: the best of many is biased upwards, so the incumbent is re-scored on
each window rather than kept at its luckiest score). Plain decoding is the incumbent of a
self-drafter until a candidate beats it. Tuning stops after ``max_trials`` trials, ``patience`` trials without
improvement, or once matchness reaches ``match_threshold``; decoding then goes on with the best.

Tuning time is held below ``max_share`` of the time decoded so far: a round that would go over
it runs no trial (so the share stays small however cheap a decode round is; with ``max_share``
below 1 the number of trials depends on timings, hence only ``max_share=1`` is reproducible).
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any

import optuna
import torch

from autotune.cost_model import CostModel
from autotune.matchness import Match, matchness, usable_window
from autotune.objective import Prediction, predict
from runtime.decoding import Decoder
from runtime.drafters import ModelDrafter, SelfDrafter
from runtime.kv_cache import KVCache
from runtime.pipeline import tree_shape
from runtime.stats import DecodeStats
from search_spaces.errors import SpaceError
from search_spaces.spaces import SearchSpace, SpaceContext
from search_spaces.strategy import PLAIN, Strategy


@dataclass(frozen=True)
class TunerSettings:
    window: int = 32  # gamma: generated tokens scored per candidate (SWIFT B.2)
    beta: int = 25  # every beta-th trial is proposed by the Bayesian sampler
    max_trials: int = 1000  # S
    patience: int = 300  # stop after this many trials without a better score
    # stop once the best candidate's matchness reaches this (SWIFT's score threshold); None = never:
    # with a draft model matchness starts near 1, and draft length / threshold still need tuning
    match_threshold: float | None = None
    max_share: float = 0.1  # tuning time stays below this share of the time decoded so far
    # a candidate replaces the incumbent when predicted this much faster on the same window
    switch_margin: float = 0.05
    trials_per_round: int = 4  # at most this many trials before one decode round (budget permitting)
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("window", "beta", "max_trials", "patience", "trials_per_round"):
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


@dataclass
class Kept:
    """A strategy the tuner switched to: its prediction and what decoding with it measured."""

    strategy: Strategy
    trial: int
    predicted_tps: float
    matchness: float
    tokens: int = 0
    seconds: float = 0.0

    @property
    def measured_tps(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None


@dataclass
class TunerState:
    trials: int = 0
    since_improvement: int = 0
    best_score: float = float("-inf")  # the incumbent's predicted tokens/s on the latest window
    best_match: float = 0.0  # and its matchness there
    tuning_s: float = 0.0
    skipped_for_budget: int = 0  # rounds that ran no trial because tuning was over its time share
    done: bool = False
    stop_reason: str = ""


def bayesian_sampler(space: SearchSpace, seed: int) -> optuna.samplers.BaseSampler:
    """GPSampler for flat spaces; TPE (multivariate, grouped) where parameters are conditional."""
    if space.conditional:
        with warnings.catch_warnings():  # `multivariate`/`group` are marked experimental by Optuna
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True)
    return optuna.samplers.GPSampler(seed=seed)


class OnlineTuner:
    def __init__(
        self,
        space: SearchSpace,
        ctx: SpaceContext,
        study: optuna.Study,
        cost: CostModel,
        settings: TunerSettings,
        initial: Strategy,
    ) -> None:
        self.space, self.ctx, self.study, self.cost, self.settings = space, ctx, study, cost, settings
        self.random = optuna.samplers.RandomSampler(seed=settings.seed)
        self.bayes = bayesian_sampler(space, settings.seed)
        self.state = TunerState()
        self.incumbent = Kept(initial, trial=-1, predicted_tps=0.0, matchness=0.0)
        self.kept: list[Kept] = [self.incumbent]
        self._incumbent_prediction: Prediction | None = None
        self._last: tuple[int, float, float, float] | None = None  # tokens, draft_s, verify_s, clock
        self._prompt_start = 0
        self._clock0: float | None = None  # first decode round seen: the time base of max_share
        self._matches: dict[Any, Match] = {}  # layer plan -> matchness on the current window
        self._matches_at = -1  # sequence length the cached matches were scored at

    # ----------------------------------------------------------------- decode hooks
    def start_prompt(self, prompt_len: int) -> None:
        self._prompt_start = prompt_len
        self._last = None

    def end_prompt(self, tokens: list[int], stats: DecodeStats) -> None:
        """Attribute the prompt's last round to the incumbent."""
        self._account(tokens, stats)
        self._last = None

    def before_round(self, decoder: Decoder, tokens: list[int], cache: KVCache, stats: DecodeStats) -> None:
        self._account(tokens, stats)
        t0 = time.perf_counter()
        if self._clock0 is None:
            self._clock0 = t0
        if self.state.done or len(tokens) - self._prompt_start < self.settings.window:
            return
        if not self._within_budget(t0, 0.0):
            self.state.skipped_for_budget += 1
            return
        try:
            for _ in range(self.settings.trials_per_round):
                if not self._trial(decoder, tokens) or not self._within_budget(t0, time.perf_counter() - t0):
                    break
        finally:
            spent = time.perf_counter() - t0
            self.state.tuning_s += spent
            if self._last is not None:  # tuning time is not decode time of the incumbent
                n, d, v, clock = self._last
                self._last = (n, d, v, clock + spent)

    def _within_budget(self, t0: float, spent_now: float) -> bool:
        """Whether tuning so far (``spent_now`` of it in this round) is within ``max_share`` of the
        time since decoding began (``max_share=1`` never stops a trial: tuning is part of that time)."""
        assert self._clock0 is not None
        elapsed = t0 + spent_now - self._clock0
        return self.state.tuning_s + spent_now <= self.settings.max_share * elapsed or self.settings.max_share >= 1.0

    def _account(self, tokens: list[int], stats: DecodeStats) -> None:
        """Attribute the round just decoded to the incumbent and refresh the cost model."""
        now = time.perf_counter()
        if self._last is not None:
            n, d, v, clock = self._last
            self.incumbent.tokens += len(tokens) - n
            self.incumbent.seconds += now - clock
            if stats.verify_s > v:  # a verify at the fixed width, or a plain single-token step
                observe = self.cost.observe_verify if self.incumbent.strategy.speculates else self.cost.observe_plain
                observe(stats.verify_s - v)
            if self._incumbent_prediction is not None:
                self.cost.observe_draft(self._incumbent_prediction.draft_seconds, stats.draft_s - d)
        self._last = (len(tokens), stats.draft_s, stats.verify_s, now)

    # ----------------------------------------------------------------- one trial
    def _trial(self, decoder: Decoder, tokens: list[int]) -> bool:
        drafter = decoder.drafter
        if not isinstance(drafter, ModelDrafter) or not usable_window(len(tokens), drafter.cache.length, self.settings.window):
            return False
        state = self.state
        if state.trials == 0 and isinstance(drafter, SelfDrafter) and self.incumbent.strategy.speculates:
            self._start_from_plain(decoder)
        use_bayes = (state.trials + 1) % self.settings.beta == 0
        self.study.sampler = self.bayes if use_bayes else self.random
        with torch.enable_grad():  # GP fitting needs autograd
            trial = self.study.ask()
        try:
            strategy = self.space.define(trial, self.ctx)
            match = self._match(drafter, strategy, tokens)
            prediction = predict(strategy, match, self.cost)
            incumbent = self._incumbent_score(drafter, tokens)
        except BaseException:  # Ctrl-C included: the trial is closed as failed, not left running
            self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
            raise
        score = prediction.tokens_per_s
        trial.set_user_attr("matchness", match.rate)
        trial.set_user_attr("tokens_per_round", prediction.tokens_per_round)
        self.study.tell(trial, score)
        state.trials += 1
        state.since_improvement += 1
        if strategy == self.incumbent.strategy:
            self.incumbent.trial = trial.number
        elif score > incumbent * (1.0 + self.settings.switch_margin):
            state.since_improvement = 0
            self._switch(decoder, strategy, trial.number, prediction, match)
        self._maybe_stop()
        return not state.done

    def _match(self, drafter: ModelDrafter, strategy: Strategy, tokens: list[int]) -> Match:
        """Matchness depends on the layer plan only: one draft forward per plan and window."""
        if self._matches_at != len(tokens):
            self._matches, self._matches_at = {}, len(tokens)
        plan = strategy.layer_plan
        if plan not in self._matches:
            self._matches[plan] = matchness(drafter.model, drafter.cache, plan, tokens, self.settings.window)
        return self._matches[plan]

    def _incumbent_score(self, drafter: ModelDrafter, tokens: list[int]) -> float:
        """The incumbent's predicted tokens/s on the same window as the candidate: scores from one
        short window are noisy, and comparing against a stale lucky score would keep a poor
        incumbent (the best of many noisy scores is biased upwards)."""
        inc = self.incumbent
        if not inc.strategy.speculates:
            score = 1.0 / self.cost.plain_step_s()
        else:
            match = self._match(drafter, inc.strategy, tokens)
            prediction = predict(inc.strategy, match, self.cost)
            self._incumbent_prediction, score = prediction, prediction.tokens_per_s
            inc.predicted_tps, inc.matchness = score, match.rate
            self.state.best_match = match.rate
        self.state.best_score = score
        return score

    def _start_from_plain(self, decoder: Decoder) -> None:
        """Plain decoding is a point of every space: a self-drafter scores candidates on the target's
        own cache, so decoding can go on without speculating until a candidate is predicted faster."""
        plain_s = self.cost.plain_step_s()
        self._incumbent_prediction = None  # plain rounds say nothing about draft or verify cost
        apply_strategy(decoder, PLAIN)
        self.incumbent = Kept(PLAIN, trial=-1, predicted_tps=1.0 / plain_s, matchness=0.0)
        self.kept.append(self.incumbent)

    def _switch(self, decoder: Decoder, strategy: Strategy, number: int, prediction: Prediction, match: Match) -> None:
        self._incumbent_prediction = prediction
        apply_strategy(decoder, strategy)
        self.incumbent = Kept(strategy, number, prediction.tokens_per_s, match.rate)
        self.kept.append(self.incumbent)
        self.state.best_score, self.state.best_match = prediction.tokens_per_s, match.rate

    def _maybe_stop(self) -> None:
        s, cfg = self.state, self.settings
        if s.trials >= cfg.max_trials:
            s.done, s.stop_reason = True, f"{cfg.max_trials} trials"
        elif s.since_improvement >= cfg.patience:
            s.done, s.stop_reason = True, f"no improvement in {cfg.patience} trials"
        elif cfg.match_threshold is not None and s.best_match >= cfg.match_threshold:
            s.done, s.stop_reason = True, f"matchness {s.best_match:.2f} >= {cfg.match_threshold}"

    @property
    def best(self) -> Strategy:
        return self.incumbent.strategy

    def summary(self) -> dict[str, Any]:
        plain_s = self.cost.plain_step_s()
        return {
            "plain_predicted_tps": 1.0 / plain_s if plain_s > 0 else None,
            "trials": self.state.trials,
            "stop_reason": self.state.stop_reason or "prompts ran out",
            "best_predicted_tps": self.incumbent.predicted_tps,
            "best_matchness": self.incumbent.matchness,
            "tuning_s": self.state.tuning_s,
            "rounds_over_budget": self.state.skipped_for_budget,
            "kept": [
                {"trial": k.trial, "strategy": k.strategy.to_dict(), "predicted_tps": k.predicted_tps,
                 "measured_tps": k.measured_tps, "matchness": k.matchness, "tokens": k.tokens}
                for k in self.kept
            ],
        }


def apply_strategy(decoder: Decoder, strategy: Strategy) -> None:
    """Make ``decoder`` draft with ``strategy`` from the next round on. Every strategy of one
    space uses the same drafting model, so the drafter is reconfigured in place (cache kept).
    ``PLAIN`` stops drafting; the drafter is kept for scoring and later strategies."""
    drafter = decoder.drafter
    if not strategy.speculates:
        decoder.draft_length = 0
        return
    if not isinstance(drafter, ModelDrafter):
        raise SpaceError(f"online tuning needs a model drafter; cannot switch to drafter '{strategy.drafter}'")
    drafter.reconfigure(tree_shape(strategy), strategy.layer_plan, strategy.calibrate)
    decoder.draft_length = strategy.draft_length
