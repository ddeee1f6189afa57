"""Adaptation inside one request: the per-request controller.

A request starts with its route's strategy, the prior. Its own first tokens show whether
drafting pays there: the target has just produced them, so scoring them costs at most one draft
forward. Every ``window`` generated tokens (gamma, as the online tuner's windows) the controller
scores a few candidates on the request's latest window, priced by the measured cost model
(``autotune.tuning.scoring``, the tuner's own scorers):

- the prior, plain decoding, prompt lookup, and the prior's cheap neighbours (a shorter chain,
  the chain instead of a tree, ``candidates``);
- the strategy decoding now is judged by what its rounds since the last decision *measured*
  where it decoded alone; every prediction is multiplied by its correction (measured / predicted
  tokens/s, ``autotune.tuning.corrections``: the tuner's scheme, learnt by the requests of a
  server per kind of traffic and pooled, ``KindCorrections``, so a strategy priced too high on
  this machine or this kind of text is priced right for the next such request);
- a drafting model is scored (one forward over the window) only while scoring stays within
  ``max_share`` of the request's decode time (``autotune.tuning.budget``; its latest prediction
  stands in between); plain decoding and prompt lookup cost no forward and are scored every
  window.

It switches between rounds to the highest score. Plain decoding wins ties: another strategy needs
``margin`` more than plain's score, and than the current strategy's. A request whose speculative
rounds *measured* slower than plain decoding, over its latest ``guard_tokens`` tokens decoded
alone, stops speculating for the rest of the request (``stopped``).

Strategy changes happen only between rounds (``Decoder.apply``: every drafter kind a candidate
needs follows the sequence on standby), so greedy output stays identical to plain decoding and
sampling keeps the target's distribution: each round is a complete speculative round of one
strategy, and the acceptance rules never see the switch.
"""
from __future__ import annotations

import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from autotune.tuning.budget import Budget
from autotune.tuning.corrections import Corrections, KindCorrections
from autotune.tuning.cost_model import CostModel
from autotune.tuning.objective import Prediction
from autotune.tuning.scoring import Window
from autotune.tuning.tuner_state import SCORING
from runtime.decoding import Decoder
from runtime.kv_cache import KVCache
from runtime.stats import DecodeStats
from search_spaces.errors import SpaceError
from search_spaces.strategy import PLAIN, Strategy

MODEL_KINDS = ("draft-model", "layer-skip")  # scored by a forward of their drafting model (the budget's)


@dataclass(frozen=True)
class ControlSettings:
    window: int = SCORING.window  # gamma: generated tokens between decisions (the first decision after the first window)
    margin: float = SCORING.margin  # a switch needs this much more predicted speed than plain and than the current strategy
    max_share: float = SCORING.max_share  # scoring a drafting model stays below this share of the request's decode time
    guard_tokens: int = 32  # speculation measured slower than plain over this many tokens stops for the request
    lookup_length: int = 8  # prompt lookup's draft length as a candidate (capped by the verify width)
    min_measured: int = 8  # tokens decoded alone since the last decision before measurement judges the current

    def __post_init__(self) -> None:
        for name in ("window", "guard_tokens", "lookup_length", "min_measured"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SpaceError(f"request control setting {name}={value!r} must be a positive integer")
        if not 0.0 <= self.margin < 1.0:
            raise SpaceError(f"request control setting margin={self.margin!r} must be in [0, 1)")
        if not 0.0 < self.max_share <= 1.0:
            raise SpaceError(f"request control setting max_share={self.max_share!r} must be in (0, 1]")


class RoutePriors:
    """Routes learn from their requests: what each route's latest ``keep`` controlled requests
    ended on. Once ``quorum`` of them ended on one strategy other than the route's stored one, the
    route's next requests start there (``start``); their controllers still score the stored
    strategy and can switch back to it. Bounded: the ``max_routes`` routes seen last.

    A moved prior speaks for the requests that moved it, so it applies only to a request at most
    as far from the route's centroid (its routing distance) as the farthest of the requests that
    voted for it. A request routed near the threshold (often another kind of text that happens to
    share words with the route) starts on the route's stored strategy: a request shorter than one
    window is decided by its start alone."""

    def __init__(self, keep: int = 4, quorum: int = 3, max_routes: int = 256) -> None:
        if not 1 <= quorum <= keep:
            raise SpaceError(f"route priors: quorum {quorum} must be in 1..keep ({keep})")
        self.keep, self.quorum, self.max_routes = keep, quorum, max_routes
        # route -> its latest requests' (final strategy, routing distance or None when not known)
        self._finals: OrderedDict[str, deque[tuple[Strategy, float | None]]] = OrderedDict()

    def observe(self, route: str, final: Strategy, distance: float | None = None) -> None:
        finals = self._finals.setdefault(route, deque(maxlen=self.keep))
        finals.append((final, distance))
        self._finals.move_to_end(route)
        while len(self._finals) > self.max_routes:
            self._finals.popitem(last=False)

    def start(self, route: str, stored: Strategy, options: Iterable[Strategy],
              distance: float | None = None) -> Strategy:
        """Where ``route``'s next request starts: ``stored``, or what most of its latest requests
        ended on when that is one of ``options`` (what its controller can switch to) and the
        request is no farther from the route (``distance``) than the farthest voter for it."""
        finals = self._finals.get(route)
        if not finals:
            return stored
        (top, n), = Counter(s for s, _ in finals).most_common(1)
        if n < self.quorum or top == stored or top not in set(options):
            return stored
        reach = [d for s, d in finals if s == top and d is not None]
        if distance is not None and len(reach) == n and distance > max(reach):  # farther than every voter
            return stored
        return top

    def describe(self) -> dict[str, list[str]]:
        return {route: [label(s) for s, _ in finals] for route, finals in self._finals.items()}


def lookup_candidate(length: int, width: int) -> Strategy | None:
    """Prompt lookup of ``length`` tokens, cut to fit a verify of ``width`` rows (None: no room)."""
    k = min(length, width - 1)
    return Strategy(drafter="prompt-lookup", draft_length=k) if k >= 1 else None


def candidates(prior: Strategy, width: int, kinds: Iterable[str], lookup_length: int) -> list[Strategy]:
    """What a request may switch to: its prior, plain decoding, prompt lookup (where the decoder has
    it) and the prior's cheap neighbours - its chain instead of its tree, and a chain half as
    long. Only strategies whose drafter the decoder holds and that fit its verify ``width``."""
    have = set(kinds)
    out = [prior, PLAIN]
    if prior.drafter == "prompt-lookup":
        if prior.draft_length > 2:
            out.append(replace(prior, draft_length=max(prior.draft_length // 2, 1)))
    elif "prompt-lookup" in have:
        look = lookup_candidate(lookup_length, width)
        if look is not None:
            out.append(look)
    if prior.drafter in MODEL_KINDS:
        chain = replace(prior, tree_widths=None, dynamic_widths=None) if (prior.tree_widths or prior.dynamic_widths) \
            else prior
        out.append(chain)
        if chain.draft_length > 2:
            out.append(replace(chain, draft_length=max(chain.draft_length // 2, 2)))
    fits = [s for s in dict.fromkeys(out)
            if not s.speculates or (s.drafter in have and s.max_tree_nodes + 1 <= width)]
    return fits if prior in fits else [prior]


def decoder_options(prior: Strategy, decoder: Decoder, settings: ControlSettings) -> list[Strategy]:
    """``candidates`` of ``prior`` that ``decoder`` can switch to (its drafters, its verify width)."""
    kinds = ([decoder.kind] if decoder.kind else []) + list(decoder.standby)
    return candidates(prior, decoder.verify_width, kinds, settings.lookup_length)


@dataclass
class Decision:
    """One window's scores and what the controller did."""

    at: int  # generated tokens when it was taken
    scores: dict[str, float]  # strategy label -> predicted (or, for the current one, measured) tokens/s
    chose: str
    switched: bool
    reason: str  # "predicted", "guard" (measured slower than plain), "kept", "unscored" (the current had no score)


def label(strategy: Strategy) -> str:
    """A short name of a strategy for the response and the logs: ``plain``, ``lookup-8``,
    ``draft-model-10``, ``draft-model-tree-4``, ``layer-skip-6``."""
    if not strategy.speculates:
        return "plain"
    kind = "lookup" if strategy.drafter == "prompt-lookup" else strategy.drafter
    shape = "-tree" if strategy.tree_widths or strategy.dynamic_widths else ""
    return f"{kind}{shape}-{strategy.draft_length}"


@dataclass
class _Stretch:
    """What the current strategy decoded since the last decision (rounds decoded alone)."""

    tokens: int = 0
    seconds: float = 0.0


class RequestController:
    """Drives one request's strategy between rounds: ``before_round`` is the decoder's round hook
    (``Decoder.generate(..., before_round=...)``; the server's batch calls it per sequence)."""

    def __init__(self, prior: Strategy, decoder: Decoder, cost: CostModel, prompt_len: int,
                 settings: ControlSettings = ControlSettings(),
                 corrections: Corrections | KindCorrections | None = None,
                 clock: Callable[[], float] = time.perf_counter, start: Strategy | None = None,
                 max_new_tokens: int | None = None) -> None:
        """``prior``: the route's strategy (its candidates are built around it); ``start``: where
        decoding starts when not there (``RoutePriors``; one of the candidates, applied here);
        ``max_new_tokens``: where the request ends at the latest (a decision whose window would
        not complete before it scores nothing: only the measured guard runs)."""
        self.prior, self.cost, self.settings, self.clock = prior, cost, settings, clock
        self.max_new_tokens = max_new_tokens
        self.corrections: Corrections | KindCorrections = corrections if corrections is not None else Corrections()
        self.options = decoder_options(prior, decoder, settings)
        self.horizon = max([s.draft_length for s in self.options if s.speculates] or [1])
        self.window = Window(settings.window, self.horizon, cost)
        self.prompt_len = prompt_len
        self.current = prior
        if start is not None and start != prior and start in self.options:
            decoder.apply(start)
            self.current = start
        self.started_with = self.current
        self.stopped = False  # speculation measured slower than plain: plain for the rest of the request
        self.decisions: list[Decision] = []
        self.switches = 0
        self.scoring_s = 0.0
        self.budget = Budget(settings.max_share, clock)
        self._next = settings.window
        self._last: tuple[int, float] | None = None  # (tokens, stats seconds) at the previous round's start
        self._alone = True  # whether the round about to run decodes alone (not in a batch)
        self._stretch = _Stretch()
        self._predicted: float | None = None  # the current strategy's prediction when it was chosen
        self._spec_rounds: list[tuple[int, float]] = []  # recent speculative rounds decoded alone: (tokens, s)
        self._model_s: float | None = self.corrections.model_s  # what scoring a drafting model last cost
        self._known: dict[Strategy, float] = {}  # each candidate's latest prediction (tokens/s)

    # ------------------------------------------------------------------ the round hook
    def before_round(self, decoder: Decoder, tokens: list[int], cache: KVCache, stats: DecodeStats,
                     alone: bool = True, batch: int = 1) -> None:
        """Before a round: account the round just decoded, and at each window decide (maybe
        switching ``decoder`` to another strategy). ``alone``: the coming round decodes alone (a
        batch's rounds share their time, so they are not measured against a solo plain step);
        ``batch``: the requests sharing the decode thread, whose controllers share one scoring
        budget, so a batch spends no more on scoring than one request does."""
        now = self.clock()
        self.budget.accrue(now, sharers=batch)
        self._account(tokens, stats)
        self._alone = alone
        generated = len(tokens) - self.prompt_len
        if generated < self._next:
            return
        self._next = generated + self.settings.window
        if self.stopped:
            return
        started = self.clock()
        try:
            if self.max_new_tokens is not None and generated + self.settings.window > self.max_new_tokens:
                self._guard_only(decoder, generated)  # no window left to pay back a score
            else:
                self._decide(decoder, tokens, generated)
        finally:
            spent = self.clock() - started
            self.scoring_s += spent
            self.budget.spend(spent)

    def _account(self, tokens: list[int], stats: DecodeStats) -> None:
        seconds = stats.draft_s + stats.verify_s
        last, self._last = self._last, (len(tokens), seconds)
        if last is None or not self._alone:
            return
        n, s = len(tokens) - last[0], seconds - last[1]
        if n <= 0 or s <= 0:
            return
        self._stretch.tokens += n
        self._stretch.seconds += s
        if not self.current.speculates:
            self.cost.observe_plain(s / n)
            return
        self._spec_rounds.append((n, s))
        while sum(t for t, _ in self._spec_rounds[1:]) >= self.settings.guard_tokens:
            self._spec_rounds.pop(0)

    # ------------------------------------------------------------------ decisions
    def finish(self, tokens: list[int], stats: DecodeStats) -> None:
        """The request ended: its last rounds teach the corrections what its current strategy
        decoded since the last decision (no round follows to do it)."""
        self._account(tokens, stats)
        self._learn()

    def _learn(self) -> None:
        """What the current strategy measured since it was chosen, against its prediction then,
        goes to the corrections (a speculative strategy with ``min_measured`` tokens decoded alone)."""
        if self._measured() is not None and self._predicted and self.current.speculates:
            self.corrections.observe(self.current, self._predicted, self._stretch.tokens, self._stretch.seconds)
            self._predicted, self._stretch = None, _Stretch()  # observed once

    def _guard_only(self, decoder: Decoder, generated: int) -> bool:
        """Speculation measured slower than plain decoding stops here (``stopped``) -> whether it did."""
        plain_tps = 1.0 / self.cost.plain_step_s()
        if not (self.current.speculates and self._guard_trips(plain_tps)):
            return False
        scores = {label(self.current): self._measured() or 0.0, "plain": plain_tps}
        self._learn()
        self._switch(decoder, PLAIN, generated, scores, "guard")
        self.stopped = True
        return True

    def _decide(self, decoder: Decoder, tokens: list[int], generated: int) -> None:
        plain_tps = 1.0 / self.cost.plain_step_s()
        measured = self._measured()
        if self._guard_only(decoder, generated):
            return
        self._learn()
        scores: dict[Strategy, float] = {}
        raw: dict[Strategy, float] = {}  # uncorrected predictions (what a measurement corrects)
        model_s, may_model = 0.0, self._may_score_model()
        for s in self.options:
            if s.drafter in MODEL_KINDS and not may_model:  # its latest prediction stands until scored again
                if s == self.current and measured is not None:
                    scores[s] = measured
                elif s in self._known:
                    scores[s] = self._known[s]
                continue
            started = self.clock()
            p = self._predict(decoder, s, tokens)
            if s.drafter in MODEL_KINDS:
                model_s += self.clock() - started
            if p is None:
                continue
            raw[s] = p
            scores[s] = self._known[s] = p * self.corrections.factor(s) if s.speculates else p
            if s == self.current and measured is not None:
                scores[s] = measured  # what it decoded beats a prediction
        if model_s > 0:
            self._model_s = self.corrections.model_s = model_s
        scores.setdefault(PLAIN, plain_tps)
        if self.current not in scores:  # neither measured nor scored yet (the budget): nothing to compare
            self.decisions.append(Decision(generated, {label(k): round(v, 3) for k, v in scores.items()},
                                           label(self.current), False, "unscored"))
            return
        best = self._choose(scores)
        reason = "predicted" if best != self.current else "kept"
        named = {label(s): round(v, 3) for s, v in scores.items()}
        if best != self.current:
            self._switch(decoder, best, generated, named, reason)
        else:
            self.decisions.append(Decision(generated, named, label(best), False, reason))
        self._predicted = raw.get(best)
        self._stretch = _Stretch()

    def _choose(self, scores: dict[Strategy, float]) -> Strategy:
        """The highest score; plain wins ties (``margin``) and the current strategy keeps its place
        against a speculative one that is not ``margin`` faster."""
        m = 1.0 + self.settings.margin
        plain = scores[PLAIN]
        best = max(scores, key=lambda s: scores[s])
        if best.speculates and scores[best] < plain * m:
            return PLAIN
        cur = scores.get(self.current)
        if best != self.current and self.current.speculates and cur is not None and best.speculates \
                and cur >= plain * m and scores[best] < cur * m:
            return self.current
        return best

    def _predict(self, decoder: Decoder, strategy: Strategy, tokens: list[int]) -> float | None:
        """Predicted tokens/s of ``strategy`` on the latest window (before its kind's correction)."""
        if not strategy.speculates:
            return 1.0 / self.cost.plain_step_s()
        try:
            got: tuple[Prediction, float] | None = self.window.predict(decoder, strategy, tokens)
        except (ValueError, RuntimeError):  # no window its drafter can score here
            return None
        if got is None:
            return None
        return got[0].tokens_per_s

    def _may_score_model(self) -> bool:
        """Scoring a drafting model costs a forward: only while the budget covers it (the first
        time, whatever it costs: nothing is known without it)."""
        return self._model_s is None or self.budget.covers(self._model_s)

    def _measured(self) -> float | None:
        st = self._stretch
        if st.tokens < self.settings.min_measured or st.seconds <= 0:
            return None
        return st.tokens / st.seconds

    def _guard_trips(self, plain_tps: float) -> bool:
        n = sum(t for t, _ in self._spec_rounds)
        s = sum(x for _, x in self._spec_rounds)
        return n >= self.settings.guard_tokens and s > 0 and n / s < plain_tps

    def _switch(self, decoder: Decoder, to: Strategy, generated: int, scores: dict[str, float], reason: str) -> None:
        decoder.apply(to)
        self.decisions.append(Decision(generated, scores, label(to), True, reason))
        self.switches += 1
        self.current = to
        self._spec_rounds = []
        self._stretch = _Stretch()

    # ------------------------------------------------------------------ reporting
    def summary(self, decode_s: float | None = None) -> dict[str, Any]:
        """The response's ``autotune.control`` object: the prior, the final strategy, the switches,
        whether speculation stopped, and what scoring cost (seconds, and its share of ``decode_s``)."""
        out: dict[str, Any] = {
            "prior": label(self.prior), "start": label(self.started_with), "final": label(self.current),
            "switches": self.switches,
            "stopped": self.stopped, "decisions": len(self.decisions), "scoring_s": round(self.scoring_s, 4),
            "path": [d.chose for d in self.decisions if d.switched],
        }
        if decode_s:
            out["scoring_share"] = round(self.scoring_s / decode_s, 4)
        return out


def controller_cost(decoder: Decoder, context: int = 512, repeats: int = 3, warm: bool = True,
                    verify_width: int | None = None) -> Any:
    """A measured cost model for ``decoder``: its drafting model (the draft model, the target for
    self-drafting, else the target) and target, timed lazily, once (``repeats``/``warm``: a live
    re-tune times models already decoding, once each)."""
    from autotune.tuning.cost_model import MeasuredCostModel

    drafting = decoder.drafter_of("draft-model") or decoder.drafter_of("layer-skip")
    return MeasuredCostModel(draft=drafting.model if drafting is not None else decoder.target, target=decoder.target,
                             verify_width=verify_width or max(decoder.verify_width, 2), context=context,
                             repeats=repeats, warm=warm, padded=decoder.pads)


def generate_controlled(decoder: Decoder, prompt: list[int], config: Any, prior: Strategy, cost: CostModel,
                        settings: ControlSettings = ControlSettings(), corrections: Corrections | None = None,
                        after_round: Callable[[list[int]], bool] | None = None) -> tuple[Any, RequestController]:
    """Decode ``prompt`` with ``prior`` under a per-request controller -> (the result, the
    controller: its ``summary``). ``decoder`` holds ``prior`` and, on standby, every drafter kind
    a candidate needs; it is left configured for ``prior``."""
    decoder.apply(prior)
    ctl = RequestController(prior, decoder, cost, len(prompt), settings, corrections,
                            max_new_tokens=config.max_new_tokens)
    try:
        result = decoder.generate(prompt, config, before_round=ctl.before_round, after_round=after_round)
    finally:
        decoder.apply(prior)
    return result, ctl
