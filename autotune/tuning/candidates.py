"""The held-out race's candidates from what the online tuner learnt: one per drafter kind
(``runner_ups``), prompt lookup's length priced over every tuned output (``best_lookup``), and the
cost model's price of the text a candidate just decoded (``price_text``, the stored pick's predicted /
measured). ``autotune.tuning.study`` judges them (``autotune.tuning.heldout``)."""
from __future__ import annotations

import optuna

from autotune.tuning.objective import replay_lookup
from autotune.tuning.scoring import Window
from autotune.tuning.tuner import OnlineTuner
from runtime.decoding import Decoder
from search_spaces.errors import SpaceError
from search_spaces.kinds import PROMPT_LOOKUP, kinds_with
from search_spaces.spaces import SearchSpace, SpaceContext
from search_spaces.strategy import Strategy


def runner_ups(tuner: OnlineTuner, space: SearchSpace, ctx: SpaceContext) -> list[tuple[Strategy, float]]:
    """The tuner's best-scored speculating trial of each drafter kind other than its incumbent's
    (a near-copy of the incumbent would say little about the task that the incumbent does not);
    where the space has no other kind, its best other strategy. Prompt lookup, where the space
    has it, is always one (its length priced over every tuned output, ``best_lookup``: a tuner
    that spent its allowance before asking for it still judges it), and so is the drafting
    model's first seed where none of its trials could be afforded. Where the incumbent is plain
    decoding, one per speculating kind: the held-out prompts decide between kinds that the tuner's
    windows did not (``auto``: at most the draft model's and prompt lookup's). -> (strategy, its
    corrected score) per kind, best first."""
    best = tuner.best
    done = [t for t in tuner.trials.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
            if t.value is not None]
    by_kind: dict[str, tuple[Strategy, float]] = {}
    same_kind: tuple[Strategy, float] | None = None
    for t in sorted(done, key=lambda t: -float(t.value)):
        try:
            s = space.define(optuna.trial.FixedTrial(t.params), ctx)
        except (SpaceError, ValueError, KeyError):
            continue
        if not s.speculates or s == best:
            continue
        if s.drafter != best.drafter or not best.speculates:
            by_kind.setdefault(s.drafter, (s, float(t.value)))
        elif same_kind is None:
            same_kind = (s, float(t.value))
    lookup = by_kind.get(PROMPT_LOOKUP)
    if lookup is None and best.drafter != PROMPT_LOOKUP and PROMPT_LOOKUP in space.kinds(ctx):
        lookup = (Strategy(drafter=PROMPT_LOOKUP, draft_length=ctx.max_draft_length), 0.0)  # never asked
    if lookup is not None:  # its whole grid priced over every tuned output: token work, no forward
        by_kind[PROMPT_LOOKUP] = best_lookup(tuner, space, ctx, lookup)
    for kind in [k.name for k in kinds_with(lambda k: k.model_drafts)]:  # a drafting model never afforded
        if kind in space.kinds(ctx) and kind not in by_kind and best.drafter != kind:
            seed = next((s for s in space.seeds(ctx) if s.drafter == kind), None)
            if seed is not None:
                by_kind[kind] = (seed, 0.0)
    found = list(by_kind.values())
    return found or ([same_kind] if same_kind else [])


def best_lookup(tuner: OnlineTuner, space: SearchSpace, ctx: SpaceContext,
                scored: tuple[Strategy, float]) -> tuple[Strategy, float]:
    """The prompt-lookup length predicted fastest over everything decoded while tuning
    (``OnlineTuner.task_tps`` at every point of its sweep grid: a replay of the text, no forward;
    with verifies that run their own rows, a shorter copy can beat the longest). -> (strategy, its
    prediction), or ``scored`` where nothing could be priced."""
    priced = [(s, tuner.task_tps(s)) for s in space.sweep(scored[0], ctx)]
    # equal predictions: the text never used the extra length; the longer copy is the one that can
    best = max(((s, v) for s, v in priced if v), key=lambda sv: (sv[1], sv[0].draft_length), default=None)
    return best if best is not None else scored


def price_text(tuner: OnlineTuner, decoder: Decoder, strategy: Strategy, tokens: list[int],
               new: int) -> tuple[int, float] | None:
    """The cost model's price of ``strategy`` on the last ``new`` tokens of ``tokens``, the text it
    just decoded (prompt lookup walked over it round by round as it decodes, ``lookup_walk``, the
    first token being the prefill's; a drafting model's matchness over one window of it, in one
    forward, from ``decoder``) -> (tokens, predicted seconds of its decode rounds), or None where
    its drafter cannot score there. Uncorrected: the replay knows what that text accepts, so the
    only error left is the cost model's (its timings and the scales decode rounds keep
    refreshing); a strategy's correction also holds how far its windows' forecasts of acceptance
    missed, and would count that error a second time."""
    if new < 4:
        return None
    if strategy.drafter == PROMPT_LOOKUP:
        tps = replay_lookup(strategy, [(len(tokens) - new, tokens)], tuner.ctx.max_draft_length, tuner.cost)
        return (new, new / tps) if tps else None
    got = Window(new, tuner.ctx.max_draft_length, tuner.cost).predict(decoder, strategy, tokens)
    if got is None or got[0].tokens_per_s <= 0:
        return None
    return new, new / got[0].tokens_per_s
