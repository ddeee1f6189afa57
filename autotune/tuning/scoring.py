"""Scoring a candidate on a window: the online tuner's prediction of its tokens/s.

A candidate is scored on the latest window scored (``window`` generated tokens; its matches are
cached until the next window, across prompts for the plans scored there): the matchness of its
drafting model's plan there in one forward (a drafter on standby scores its all-layer plan with
its catch-up forward), or a replay of prompt lookup on the tokens, turned into time by the
measured cost model (``autotune.tuning.objective``). Each drafter kind's ``score`` part (attached
here to the registry, ``search_spaces.kinds``) says how it is scored; the tuner multiplies the prediction by the strategy's correction (``Race.correction``).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from autotune.tuning.cost_model import CostModel
from autotune.tuning.matchness import LookupMatch, Match, lookup_match, matchness, score_logits, usable_window
from autotune.tuning.objective import Prediction, predict, predict_lookup, predict_lookup_first, predict_plain
from runtime.decoding import Decoder
from runtime.drafters import ModelDrafter
from search_spaces.kinds import DRAFT_MODEL, LAYER_SKIP, NONE, PROMPT_LOOKUP, attach, kind_of
from search_spaces.strategy import LOOKUP_FIRST_MIN_NGRAM, Strategy

LOOKUP_FIRST_KEY = ("lookup-first", None)  # window cache: the n-gram replay of `lookup_first` drafts


class Window:
    """The latest window scored and the matches cached on it (``size`` tokens; drafts up to
    ``horizon`` long): trials score there until the next window is scored."""

    def __init__(self, size: int, horizon: int, cost: CostModel) -> None:
        self.size, self.horizon, self.cost = size, horizon, cost
        self.cache: dict[Any, Match | LookupMatch] = {}  # (kind, plan) -> its match on the window
        self._cache_for: list[int] = []  # the tokens the cached matches were scored on
        self.at = 0  # sequence length of the latest window scored
        # the tokens of the latest window scored (maybe of an earlier prompt): trials score there;
        # ``stale`` once another prompt began (only plans already scored there can be scored)
        self.tokens: list[int] = []
        self.stale = True
        # the tuning allowance, where a drafting model's catch-up must fit it before it runs
        # (``TunerSettings.defer_catch_up``): seconds -> whether the allowance covers them
        self.afford: Callable[[float], bool] | None = None

    def is_stale(self, tokens: list[int]) -> bool:
        """Whether ``tokens`` is the latest window scored and it belongs to an earlier prompt
        (then only plans already scored there can be scored)."""
        return self.stale and tokens is self.tokens

    def mark(self, tokens: list[int]) -> None:
        """``tokens`` is the latest window scored: trials score there (reusing its matches) until
        the next one, ``size`` tokens on."""
        self.at = len(tokens)
        self.tokens, self.stale = list(tokens), False

    def new_prompt(self, prompt_len: int) -> None:
        """A prompt starts: the next window is ``size`` tokens into it, and the drafters' caches now
        hold another sequence (the latest window scored is stale)."""
        self.at = prompt_len
        self.stale = True

    def predict(self, decoder: Decoder, strategy: Strategy, tokens: list[int]) -> tuple[Prediction, float] | None:
        """-> (prediction, matchness) of ``strategy`` on ``tokens`` (the window), or None when its
        drafter cannot score there."""
        if self._cache_for != tokens:  # another window (or sequence): nothing of it scored yet
            self.cache, self._cache_for = {}, list(tokens)
        scorer: Scorer = kind_of(strategy.drafter).part("score")
        return scorer(self, decoder, strategy, tokens)


Scorer = Callable[[Window, Decoder, Strategy, list[int]], "tuple[Prediction, float] | None"]


def _score_plain(win: Window, decoder: Decoder, strategy: Strategy, tokens: list[int]) -> tuple[Prediction, float]:
    return predict_plain(win.cost), 0.0


def _score_model(win: Window, decoder: Decoder, strategy: Strategy, tokens: list[int]) -> tuple[Prediction, float] | None:
    """A drafting model (a draft model, or the target skipping layers): matchness of its plan on
    the window, in one forward (cached per plan and window)."""
    drafter = decoder.drafter_of(strategy.drafter)
    if not isinstance(drafter, ModelDrafter):
        return None
    window = win.size
    plan = strategy.layer_plan
    identity = plan is None or plan.is_identity
    key = (strategy.drafter, None if identity else plan)
    match = win.cache.get(key)
    if match is None and win.is_stale(tokens):  # an earlier prompt's: the cache holds another sequence
        return None
    if match is None and win.afford is not None:  # its forward waits until the allowance covers it
        # the catch-up over the rows it has not seen (the window's included), and a plan's own pass
        rows = max(len(tokens) - 1 - drafter.cache.length, 0) + (0 if identity else min(window, len(tokens) - 1))
        if rows > 0 and not win.afford(win.cost.catch_up_s(rows)):
            return None
    if match is None:
        if identity:  # on standby: its catch-up forward scores the window too
            logits = drafter.sync_scoring(tokens, window)
            if logits is not None:
                w = logits.shape[0]
                match = win.cache[key] = score_logits(logits, torch.tensor(tokens[len(tokens) - w:]))
    if match is None:
        if not usable_window(len(tokens), drafter.cache.length, window):
            drafter.sync()  # on standby: its cache lags by the tokens decoded without it
            if not usable_window(len(tokens), drafter.cache.length, window):
                return None
        match = win.cache[key] = matchness(drafter.model, drafter.cache, strategy.layer_plan, tokens, window)
    horizon = win.horizon
    if strategy.lookup_first:  # rounds where an n-gram recurs copy it; the model drafts the rest
        copies = win.cache.get(LOOKUP_FIRST_KEY)
        if copies is None:
            copies = win.cache[LOOKUP_FIRST_KEY] = lookup_match(tokens, window, horizon, LOOKUP_FIRST_MIN_NGRAM)
        assert isinstance(match, Match) and isinstance(copies, LookupMatch)
        return predict_lookup_first(strategy, match, copies, win.cost, horizon), match.rate
    return predict(strategy, match, win.cost, horizon), match.rate


def _score_lookup(win: Window, decoder: Decoder, strategy: Strategy, tokens: list[int]) -> tuple[Prediction, float]:
    key = (PROMPT_LOOKUP, None)
    match = win.cache.get(key)
    if match is None:
        match = win.cache[key] = lookup_match(tokens, win.size, win.horizon)
    assert isinstance(match, LookupMatch)
    return predict_lookup(strategy, match, win.cost, win.horizon), match.rate


# how a strategy of each kind is scored on the current window
attach(NONE, score=_score_plain)
attach(DRAFT_MODEL, score=_score_model)
attach(LAYER_SKIP, score=_score_model)
attach(PROMPT_LOOKUP, score=_score_lookup)
