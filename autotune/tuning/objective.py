"""The tuning objective: predicted tokens/s of a strategy, from its acceptance profile on the
generated context (matchness) and the measured cost model.

Leviathan et al. theorem 3.8 gives E[tokens per round] = (1 - a^(k+1)) / (1 - a) for an i.i.d.
acceptance rate a. We generalise it by replaying the window instead of assuming i.i.d.: for
every start position the chain (or tree, through top-w hits per depth) is drafted as the
strategy would - stopping early when the draft's confidence falls below the threshold - and its
accepted prefix counted. Time per round = the round's first draft forward (with bonus calibration
an exact forward over the accepted tokens + bonus) + the further draft forwards + one verify.
"""
from __future__ import annotations

from dataclasses import dataclass

from autotune.tuning.cost_model import CostModel
from autotune.tuning.matchness import TOP_K, LookupMatch, Match, lookup_match
from runtime.drafters import tree_shape
from search_spaces.strategy import Strategy


@dataclass(frozen=True)
class Prediction:
    tokens_per_round: float
    draft_forwards: float  # per round, the first (catch-up) one included
    seconds_per_round: float
    draft_seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_round / self.seconds_per_round if self.seconds_per_round > 0 else 0.0


def _hit_column(width: int) -> int:
    """The TOP_K column that answers 'is the target's token among this many candidates'."""
    return max(i for i, k in enumerate(TOP_K) if k <= max(width, 1))


def _starts(window: int, k: int, horizon: int | None) -> range:
    """The window's start positions a round is replayed from: those leaving room for a draft of
    ``horizon`` tokens (default: this strategy's own length). Strategies compared with each other
    take one horizon, so that each is averaged over the same positions (a longer draft would
    otherwise be judged on fewer, earlier ones)."""
    h = max(k, horizon or 0)
    return range(max(1, window - h)) if window > h else range(window)


def _rounds(strategy: Strategy, match: Match, starts: range) -> list[tuple[int, int, int]]:
    """(accepted drafts, drafted tokens, extra draft forwards) of a round from each start."""
    k, eps = strategy.draft_length, strategy.confidence_threshold
    widths = strategy.tree_widths or (1,) * k
    hits, conf = match.hits, match.confidence.tolist()
    w = match.window
    out = []
    for i in starts:
        accepted, alive, drafted, forwards = 0, True, 0, 0
        for d in range(k):
            pos = i + d
            if pos >= w:
                break
            if d > 0:
                forwards += 1  # the forward that produced this depth's distribution
                if conf[pos] < eps:
                    break
            drafted += 1
            if alive and bool(hits[pos, _hit_column(widths[d])]):
                accepted += 1
            else:
                alive = False
        out.append((accepted, drafted, forwards))
    return out


def replay(strategy: Strategy, match: Match, horizon: int | None = None) -> tuple[float, float, float]:
    """-> (mean accepted drafts, mean drafted tokens, mean extra draft forwards) per round."""
    rounds = _rounds(strategy, match, _starts(match.window, strategy.draft_length, horizon))
    n = max(len(rounds), 1)
    return tuple(sum(r[j] for r in rounds) / n for j in range(3))  # type: ignore[return-value]


def _draft_s(strategy: Strategy, accepted: float, extra_forwards: float, cost: CostModel,
             copy_rows: float = 0.0) -> float:
    """Draft time of a model round that accepts ``accepted`` drafts after ``extra_forwards``
    forwards beyond the first: the first is a plain step, or with bonus calibration an exact
    forward over the accepted tokens + bonus (one forward over that many rows); a checked lookup
    copy adds its ``copy_rows`` to that first forward."""
    step = cost.draft_forward_s(strategy.layer_plan)
    plan = strategy.layer_plan
    calibrates = strategy.drafter == "draft-model" and strategy.calibrate and plan is not None and not plan.is_identity
    first = cost.catch_up_s(accepted + 1.0) if calibrates else step
    if copy_rows:
        first += cost.catch_up_s(1.0 + copy_rows) - cost.catch_up_s(1.0)
    return first + extra_forwards * step


def verify_rows(strategy: Strategy, drafted: float) -> float:
    """Target rows of a round that drafted ``drafted`` tokens (a chain's) or a tree (all its nodes)."""
    return 1.0 + (drafted if not strategy.tree_widths else float(strategy.max_tree_nodes))


def predict(strategy: Strategy, match: Match, cost: CostModel, horizon: int | None = None) -> Prediction:
    accepted, drafted, extra_forwards = replay(strategy, match, horizon)
    draft_s = _draft_s(strategy, accepted, extra_forwards, cost)
    return Prediction(
        tokens_per_round=accepted + 1.0,
        draft_forwards=1.0 + extra_forwards,
        seconds_per_round=draft_s + cost.verify_s(verify_rows(strategy, drafted)),
        draft_seconds=draft_s,
    )


def predict_lookup_first(strategy: Strategy, match: Match, copies: LookupMatch, cost: CostModel,
                         horizon: int | None = None) -> Prediction:
    """A draft model with ``lookup_first``: from each start, a round that finds a recurring n-gram
    (``copies``, replayed with the strategy's n-gram) starts from its copy; any other is the
    model's round as ``predict`` replays it. Expected tokens over expected seconds per round.

    A chain checks the copy: it drafts (and so accepts) what the model alone would, and each
    copied token the draft keeps saves one sequential forward. Where the draft's token is the
    target's, the copy's is the draft's exactly when it is the target's, so the kept tokens are
    ``min(copy accepted, model accepted)``; the copy's rows join the round's first forward.
    A tree's lookup round is the copy alone: its accepted prefix, one verify, no draft forward."""
    w = min(match.window, copies.window)
    skip_m, skip_c = match.window - w, copies.window - w  # align both on the last w positions
    aligned = Match(match.hits[skip_m:], match.confidence[skip_m:])
    k = strategy.draft_length
    starts = _starts(w, k, horizon)
    checked = tree_shape(strategy).is_chain  # the drafter's ``checks_copies``
    tokens = draft = verify = 0.0
    for (accepted, drafted, forwards), i in zip(_rounds(strategy, aligned, starts), starts):
        proposed = copies.proposed[skip_c + i]
        if proposed > 0 and checked:
            rows = min(proposed, k)
            kept = min(copies.accepted[skip_c + i], accepted, rows)
            tokens += accepted + 1.0
            draft += _draft_s(strategy, accepted, forwards - min(kept, forwards), cost, copy_rows=rows)
            verify += cost.verify_s(verify_rows(strategy, drafted))
        elif proposed > 0:
            tokens += min(copies.accepted[skip_c + i], k) + 1.0
            verify += cost.verify_s(1.0 + min(proposed, k))
        else:
            tokens += accepted + 1.0
            draft += _draft_s(strategy, accepted, forwards, cost)
            verify += cost.verify_s(verify_rows(strategy, drafted))
    n = max(len(starts), 1)
    seconds = draft + verify  # every round verifies once
    return Prediction(tokens_per_round=tokens / n, draft_forwards=0.0, seconds_per_round=seconds / n,
                      draft_seconds=draft / n)


def predict_plain(cost: CostModel) -> Prediction:
    """Plain decoding: one token per single-row target step."""
    return Prediction(tokens_per_round=1.0, draft_forwards=0.0, seconds_per_round=cost.plain_step_s(), draft_seconds=0.0)


def predict_lookup(strategy: Strategy, match: LookupMatch, cost: CostModel, horizon: int | None = None) -> Prediction:
    """Prompt lookup, replayed as it decodes (``lookup_rounds``): drafting is a dict lookup (no
    forward); a round that found a match verifies its 1 + proposed rows (the padded width where
    the decoder pads), one that found none is a plain single-row step."""
    return _lookup_prediction(lookup_rounds(match, strategy.draft_length, horizon), cost)


def predict_lookup_text(strategy: Strategy, match: LookupMatch, cost: CostModel) -> Prediction:
    """Prompt lookup over a whole output (``match`` spans it all), walked as it decodes
    (``lookup_walk``): what decoding that output again with ``strategy`` costs."""
    return _lookup_prediction(lookup_walk(match, strategy.draft_length), cost)


def _lookup_prediction(rounds: list[tuple[int, int, float]], cost: CostModel) -> Prediction:
    """(accepted, proposed, weight) per round -> tokens/s: a round that found a match verifies its
    1 + proposed rows, one that found none is a plain single-row step."""
    n = sum(w for _, _, w in rounds)
    if n <= 0:
        return predict_plain(cost)
    tokens = sum(w * (a + 1.0) for a, _, w in rounds)
    seconds = sum(w * (cost.verify_s(1.0 + p) if p > 0 else cost.plain_step_s()) for _, p, w in rounds)
    return Prediction(tokens_per_round=tokens / n, draft_forwards=0.0, seconds_per_round=seconds / n, draft_seconds=0.0)


def lookup_rounds(match: LookupMatch, k: int, horizon: int | None = None) -> list[tuple[int, int, float]]:
    """The rounds prompt lookup of length ``k`` decodes over the window, as it decodes them: from
    each phase (so that where the window starts does not decide what is found), a round at
    position ``i`` proposes ``min(proposed[i], k)`` tokens, accepts ``min(accepted[i], k)`` of
    them, and the next round starts after them and the target's token. Its tokens are greedy
    decoding's own, so on the window this is what lookup would do. Every length is walked over the
    same positions, those where a draft of ``horizon`` still fits in the window (as ``_starts``),
    from the same phases ``0 .. horizon``; the round that crosses the end counts for the share of
    its tokens before it. -> (accepted, proposed, weight) per round, over all phases.

    Averaging every position instead (a round starting everywhere) under-counts what recurring
    text gives: inside a copied stretch a round accepts ``k`` tokens and jumps ``k + 1`` ahead,
    so stretches that copy take few rounds and the rest one token each."""
    end = len(_starts(match.window, k, horizon))
    out: list[tuple[int, int, float]] = []
    for phase in range(min(max(k, horizon or 0) + 1, end)):
        i = phase
        while i < end:
            p = min(match.proposed[i], k)
            a = min(match.accepted[i], p)
            out.append((a, p, min(1.0, (end - i) / (a + 1.0))))
            i += a + 1
    return out


def lookup_walk(match: LookupMatch, k: int) -> list[tuple[int, int, float]]:
    """The rounds prompt lookup of length ``k`` decodes over a whole output (``match`` spans it:
    position 0 is its first token), exactly as it decodes it: the first token is the prefill's,
    the first round starts after it, each round proposes ``min(proposed[i], k)`` tokens (no more
    than the output has left after the round's own token: decoding caps a draft by the tokens
    still to generate), accepts ``min(accepted[i], proposed)`` and the next starts after them and
    the target's token. -> (accepted, proposed, 1.0) per round.

    ``lookup_rounds`` averages phases over the positions a longer draft still fits, which suits a
    window in the middle of a stream; over a whole output it leaves out where the output starts
    (often new text, decoded a token a round) and its end, and predicts too fast."""
    w = len(match.proposed)
    out: list[tuple[int, int, float]] = []
    i = 1
    while i < w:
        p = min(match.proposed[i], k, w - i - 1)
        a = min(match.accepted[i], p)
        out.append((a, p, 1.0))
        i += a + 1
    return out


def replay_lookup(strategy: Strategy, decoded: list[tuple[int, list[int]]], max_length: int,
                  cost: CostModel) -> float | None:
    """Prompt lookup's predicted tokens/s over whole texts (``decoded``: each prompt's length and
    prompt + output), every output walked in full as it would decode (``lookup_walk``); None when
    none could be."""
    tokens = seconds = 0.0
    for start, seq in decoded:
        n = len(seq) - start
        if n < 2:
            continue
        got = predict_lookup_text(strategy, lookup_match(seq, n, max_length), cost)
        if got.tokens_per_s > 0:  # the rounds decode all but the first token (the prefill's)
            tokens, seconds = tokens + n, seconds + (n - 1) / got.tokens_per_s
    return tokens / seconds if seconds > 0 else None
