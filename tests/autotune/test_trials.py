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
    trials = Trials(optuna.create_study(direction="maximize"), space, CTX, seed=0, beta=2)
    seeds = [s for s in space.seeds(CTX) if s.speculates]
    assert len(seeds) >= 2
    for s in [*seeds, seeds[0], PLAIN]:  # a repeat and plain decoding are not enqueued
        trials.enqueue(s)
    labels = []
    for i in range(len(seeds) + 3):
        if i == 1:  # a swept point is added finished: it never waits to be asked
            trials.tell_swept(seeds[-1], 1.0, 1.0, 0.5)
        trial, sampler = trials.ask()
        labels.append(sampler)
        assert (sampler == "enqueued") == _fixed(trials, trial.number)
        if sampler == "enqueued":
            assert space.define(trial, CTX) in seeds
        trials.tell(trial, sampler, space.define(trial, CTX), 1.0, 1.0, 0.5)
    assert labels[: len(seeds)] == ["enqueued"] * len(seeds)
    # every second sampled trial is Bayesian: the enqueued ones do not count towards beta
    assert labels[len(seeds):] == ["random", "bayes", "random"]


def test_a_resumed_study_does_not_count_as_enqueued() -> None:
    """Trials copied in from a resumed study are finished: the first ask is the sampler's."""
    space = get_space("auto")
    first = Trials(optuna.create_study(direction="maximize"), space, CTX, seed=0, beta=2)
    trial, sampler = first.ask()
    first.tell(trial, sampler, space.define(trial, CTX), 2.0, 2.0, 0.5)
    resumed = Trials(first.study, space, CTX, seed=1, beta=2)
    trial, sampler = resumed.ask()
    assert sampler == "random" and not _fixed(resumed, trial.number)


def test_flush_copies_finished_trials_behind_a_waiting_one() -> None:
    """An enqueued trial not yet asked waits in the working study; the swept and told trials
    after it are copied at the flush all the same, and the waiting one once it finishes (a
    study whose prompt ended with a neighbour still queued kept only the trials before it)."""
    space = get_space("auto")
    persistent = optuna.create_study(direction="maximize")
    trials = Trials(persistent, space, CTX, seed=0, beta=2)
    seeds = [s for s in space.seeds(CTX) if s.speculates]
    trial, sampler = trials.ask()
    trials.tell(trial, sampler, space.define(trial, CTX), 1.0, 1.0, 0.5)
    trials.enqueue(seeds[0])  # waits: nothing asks it before the flush
    for s in seeds[1:3]:
        trials.tell_swept(s, 2.0, 2.0, 0.5)
    trials.flush()
    assert len(persistent.trials) == 3 and all(t.state.is_finished() for t in persistent.trials)
    trials.flush()  # nothing new: nothing copied twice
    assert len(persistent.trials) == 3
    trial, sampler = trials.ask()
    assert sampler == "enqueued"
    trials.tell(trial, sampler, space.define(trial, CTX), 3.0, 3.0, 0.5)
    trials.flush()
    assert len(persistent.trials) == 4 and persistent.best_value == 3.0


def test_unscorable_trials_are_pruned_so_tpe_stops_proposing_them() -> None:
    """A draft-model trial the allowance cannot score is pruned (``Trials.prune``): TPE ranks it
    below every scored trial and turns to what it can score. Power check: told FAIL instead (as
    before), TPE ignores it and proposed the draft model on nearly every later trial (40 of 40 in
    the study's replay)."""
    space = get_space("auto")
    ctx = SpaceContext(n_layers=28, draft_layers=24, max_draft_length=12)
    proposed = {}
    for close in ("prune", "fail"):
        trials = Trials(optuna.create_study(direction="maximize"), space, ctx, seed=0, beta=1)  # every trial Bayesian
        drafts = 0
        for i in range(60):
            trial, sampler = trials.ask()
            strategy = space.define(trial, ctx)
            if i >= 20:
                drafts += strategy.drafter == "draft-model"
            if strategy.drafter == "draft-model":
                getattr(trials, close)(trial)
            else:
                trials.tell(trial, sampler, strategy, 2.0 if strategy.drafter == "prompt-lookup" else 1.0, 1.0, 0.5)
        proposed[close] = drafts
    assert proposed["prune"] <= 10 and proposed["fail"] >= 30, proposed
