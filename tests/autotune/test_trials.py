"""The tuner's own count of enqueued trials (``autotune.tuning.trials``) labels asked trials as
Optuna itself recorded them: a trial is ``enqueued`` exactly when ``ask`` popped an enqueued one."""
from __future__ import annotations

import warnings

import optuna

from autotune.tuning.trials import Trials
from search_spaces.spaces import SpaceContext, get_space
from search_spaces.strategy import PLAIN

CTX = SpaceContext(n_layers=8, draft_layers=8, max_draft_length=6)


def _fixed(trials: Trials, number: int) -> bool:
    """Optuna's own record: an enqueued trial carries its fixed parameters."""
    with warnings.catch_warnings():  # FrozenTrial.system_attrs is deprecated, still the ground truth
        warnings.simplefilter("ignore")
        return "fixed_params" in trials.study.trials[number].system_attrs


def test_enqueued_trials_are_labelled_as_optuna_popped_them() -> None:
    space = get_space("auto")
    trials = Trials(optuna.create_study(direction="maximize"), space, CTX, seed=0)
    seeds = [s for s in space.seeds(CTX) if s.speculates]
    assert len(seeds) >= 2
    for s in [*seeds, seeds[0], PLAIN]:  # a repeat and plain decoding are not enqueued
        trials.enqueue(s)
    labels = []
    for i in range(len(seeds) + 3):
        if i == 1:  # a swept point is added finished: it never waits to be asked
            trials.tell_swept(seeds[-1], 1.0, 1.0, 0.5)
        trial, sampler = trials.ask(use_bayes=i % 2 == 1)
        labels.append(sampler)
        assert (sampler == "enqueued") == _fixed(trials, trial.number)
        if sampler == "enqueued":
            assert space.define(trial, CTX) in seeds
        trials.tell(trial, sampler, space.define(trial, CTX), 1.0, 1.0, 0.5)
    assert labels[: len(seeds)] == ["enqueued"] * len(seeds)
    assert labels[len(seeds):] == ["random" if i % 2 == 0 else "bayes" for i in range(len(seeds), len(seeds) + 3)]


def test_a_resumed_study_does_not_count_as_enqueued() -> None:
    """Trials copied in from a resumed study are finished: the first ask is the sampler's."""
    space = get_space("auto")
    first = Trials(optuna.create_study(direction="maximize"), space, CTX, seed=0)
    trial, sampler = first.ask(use_bayes=False)
    first.tell(trial, sampler, space.define(trial, CTX), 2.0, 2.0, 0.5)
    resumed = Trials(first.study, space, CTX, seed=1)
    trial, sampler = resumed.ask(use_bayes=False)
    assert sampler == "random" and not _fixed(resumed, trial.number)
