"""The online tuner's trials, ask-and-tell with Optuna.

Trials go to an in-memory working study (Optuna's RDB writes would cost more than the trials) and
are copied to the persistent one at the end of each prompt (``Trials.flush``); a resumed study's
trials are copied in first, so the samplers learn from them too. ``ask`` gives first the enqueued
strategies (a resumed study's best, the space's seeds, the incumbent's neighbours), otherwise a
random candidate or, every ``beta``-th sampled trial, the Bayesian sampler's (GPSampler, or TPE for
conditional spaces). Swept points are recorded as finished trials (sampler ``sweep``), so the
Bayesian sampler learns from them as well.
"""
from __future__ import annotations

import warnings

import optuna
import torch

from search_spaces.spaces import SearchSpace, SpaceContext
from search_spaces.strategy import Strategy


def bayesian_sampler(space: SearchSpace, seed: int) -> optuna.samplers.BaseSampler:
    """GPSampler for flat spaces; TPE (multivariate, grouped) where parameters are conditional."""
    if space.conditional:
        with warnings.catch_warnings():  # `multivariate`/`group` are marked experimental by Optuna
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True)
    return optuna.samplers.GPSampler(seed=seed)


class Trials:
    """The working study, its samplers and what was enqueued in it; ``persistent``: where the
    trials are kept."""

    def __init__(self, persistent: optuna.Study, space: SearchSpace, ctx: SpaceContext, seed: int,
                 beta: int) -> None:
        self.persistent, self.space, self.ctx, self.beta = persistent, space, ctx, beta
        self._sampled = 0  # trials sampled (not enqueued) so far
        # numbers of the working study's trials already in the persistent one (or copied from it)
        self._flushed: set[int] = set()
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=seed))
        if persistent.trials:  # resumed: the sampler learns from the earlier trials too
            self.study.add_trials([t for t in persistent.trials if t.state.is_finished()])
            self._flushed = {t.number for t in self.study.get_trials(deepcopy=False)}
        self.random = optuna.samplers.RandomSampler(seed=seed)
        self.bayes = bayesian_sampler(space, seed)
        self._queued: set[Strategy] = set()  # strategies enqueued so far (seeds, neighbours)
        # of which ``ask`` has not popped yet: Optuna pops enqueued (waiting) trials first, oldest
        # first; swept points are added finished and never wait
        self._waiting = 0

    def enqueue(self, strategy: Strategy) -> None:
        """Enqueue a speculating ``strategy`` (once: a strategy enqueued before is not again)."""
        if strategy.speculates and strategy not in self._queued:
            self._queued.add(strategy)
            self.study.enqueue_trial(self.space.encode(strategy, self.ctx))
            self._waiting += 1

    def ask(self) -> tuple[optuna.trial.Trial, str]:
        """-> a new trial and the sampler it came from: ``enqueued`` while strategies wait, else
        every ``beta``-th sampled trial ``bayes``, the others ``random``. Enqueued trials do not
        count towards ``beta``: a study whose windows enqueue many neighbours still gives the
        Bayesian sampler its share of the trials it samples."""
        if self._waiting > 0:  # Optuna pops the oldest enqueued trial first
            self.study.sampler = self.random
            trial = self.study.ask()
            self._waiting -= 1
            return trial, "enqueued"
        self._sampled += 1
        use_bayes = self._sampled % self.beta == 0
        self.study.sampler = self.bayes if use_bayes else self.random
        with torch.enable_grad():  # GP fitting needs autograd
            trial = self.study.ask()
        return trial, "bayes" if use_bayes else "random"

    def fail(self, trial: optuna.trial.Trial) -> None:
        self.study.tell(trial, state=optuna.trial.TrialState.FAIL)

    def prune(self, trial: optuna.trial.Trial) -> None:
        """Close a trial its drafter could not score now (a drafting model's forward the allowance
        does not cover): pruned, with no value. TPE ranks such trials below every scored one, so
        it stops proposing what cannot be scored within the budget; the random sampler does not
        care."""
        trial.set_user_attr("unscored", True)
        self.study.tell(trial, state=optuna.trial.TrialState.PRUNED)

    def tell(self, trial: optuna.trial.Trial, sampler: str, strategy: Strategy, score: float, raw: float,
             rate: float) -> None:
        """Finish ``trial`` with its corrected ``score``; its sampler, drafter kind, matchness
        (``rate``) and uncorrected prediction (``raw``) go with it."""
        trial.set_user_attr("sampler", sampler)
        trial.set_user_attr("drafter", strategy.drafter)
        trial.set_user_attr("matchness", rate)
        trial.set_user_attr("raw_tps", raw)
        self.study.tell(trial, score)

    def tell_swept(self, strategy: Strategy, score: float, raw: float, rate: float) -> int:
        """Record a swept point as a finished trial of the working study (-> its number)."""
        params, distributions = self.space.encode_trial(strategy, self.ctx)
        self.study.add_trial(optuna.trial.create_trial(
            params=params, distributions=distributions, value=score,
            user_attrs={"sampler": "sweep", "drafter": strategy.drafter, "matchness": rate, "raw_tps": raw},
        ))
        return len(self.study.get_trials(deepcopy=False)) - 1

    def flush(self) -> None:
        """Copy the trials finished since the last flush into the persistent study. An enqueued
        trial still waiting to be asked does not hold back the finished ones after it (swept
        points are added finished behind it); it is copied once it finishes."""
        finished = [t for t in self.study.get_trials(deepcopy=False)
                    if t.number not in self._flushed and t.state.is_finished()]
        if finished and self.persistent is not self.study:
            self.persistent.add_trials(finished)
        self._flushed.update(t.number for t in finished)
