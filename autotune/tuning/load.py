"""Speculation that adapts to load: how many tokens each sequence of a batch drafts this step.

A batched step costs its drafting plus one target forward over every sequence's rows.
:class:`StepCost` prices that forward as a function of the batch's rows and sequences (fitted on a
start-up profile and the real steps since); :class:`DraftCost` prices a draft model's depth
forwards, each run once for every sequence drafting at that depth (a price per forward, shared,
and one per sequence in it); and
:func:`choose_lengths` picks each sequence's draft length (up to its strategy's, or none) to
maximise the batch's goodput: expected tokens per second over the whole step (SmartSpec's goodput
model; Leviathan's expected accepted length per sequence, ``(1 - a^(k+1)) / (1 - a)``). A sequence's
acceptance starts from its route's: the live figure of the route's finished requests
(:class:`RouteAcceptance`) once there is one, else the stored strategy's.

The best length falls as the batch grows: rows that were nearly free at batch 1 (a verify of 8 rows
costs about one row's forward on CPU) compete with batch-mates' plain rows at batch 16.
"""
from __future__ import annotations

from bisect import bisect_right
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import nnls

from search_spaces.strategy import Strategy

STEPS_KEPT = 256  # real steps the step cost is fitted on (with the start-up profile)
CATCH_UPS_KEPT = 32  # a drafting model's latest catch-ups its price is fitted on
DRAFT_STEPS_KEPT = 128  # a draft model's latest drafting phases its depth price is fitted on
PRIOR_DRAFTS = 8  # pseudo-drafts of the route's acceptance before a sequence's own rounds count
DEFAULT_ACCEPTANCE = 0.6  # a sequence of a route that stored no acceptance
ROUTE_EWMA = 0.3  # weight of a route's newest finished request in its live acceptance
ROUTE_MIN_DRAFTS = PRIOR_DRAFTS  # drafts a route's live acceptance needs before it replaces the stored figure


@dataclass(frozen=True)
class Shape:
    """A draft a sequence may run this step: ``length`` depths, at most ``width`` children per node
    (None: its strategy's tree as it is), its target ``rows`` and the tokens a round is expected to
    append."""

    length: int
    width: int | None
    rows: int
    tokens: float


@dataclass(frozen=True)
class Candidate:
    """One sequence's choice this step: up to ``max_length`` draft tokens; a tree (``widths``) may
    also draft narrower, down to a chain."""

    acceptance: float  # per-token acceptance estimate (0..1)
    max_length: int  # its strategy's draft length (0: plain decoding)
    draft_token_s: float  # seconds to draft one token (0 for prompt lookup)
    rows: Callable[[int], int] = lambda k: 1 + k  # target rows of a chain of length k
    widths: tuple[int, ...] = ()  # a tree's children per node by depth (empty: a chain)
    # a one-off price of drafting at all: its draft model's catch-up over the sequence so far, not
    # run yet (0: paid, or none), paid back over the ``remaining`` tokens it may still decode
    start_s: float = 0.0
    remaining: int = 1
    # a depth forward's own price (``DraftCost.fixed``), paid once per depth by every candidate of
    # one ``draft_group`` together (their drafts run as one batched forward); None: its own
    draft_fixed_s: float = 0.0
    draft_group: str | None = None

    @classmethod
    def of(cls, strategy: Strategy, acceptance: float, draft_token_s: float, start_s: float = 0.0,
           remaining: int = 1, draft_fixed_s: float = 0.0, draft_group: str | None = None) -> Candidate:
        """``strategy``'s candidate: its draft length (0 for plain decoding), rows and tree widths."""
        spec = strategy.speculates
        return cls(acceptance, strategy.draft_length if spec else 0, draft_token_s, strategy_rows(strategy),
                   tuple(strategy.tree_widths or ()) if spec else (), start_s=start_s, remaining=remaining,
                   draft_fixed_s=draft_fixed_s, draft_group=draft_group)

    def start_share(self, tokens: float) -> float:
        """The catch-up's share of a round that appends ``tokens``: ``start_s`` spread evenly over
        the tokens left to decode (a request near its end does not pay it back)."""
        return self.start_s * tokens / max(self.remaining, 1)

    def shapes(self) -> list[Shape]:
        """Every draft this candidate may run, the ones no other beats on rows and tokens both,
        by rows: a chain's lengths; a tree's lengths at every width cap."""
        if not self.widths or max(self.widths) <= 1:
            options = [Shape(k, None, self.rows(k), expected_tokens(self.acceptance, k)) for k in range(self.max_length + 1)]
        else:
            top = max(self.widths)
            options = [Shape(k, None if cap == top else cap, *_tree(self.acceptance, [min(w, cap) for w in self.widths[:k]]))
                       for k in range(min(self.max_length, len(self.widths)) + 1) for cap in range(1, top + 1)]
        frontier: list[Shape] = []
        for s in sorted(options, key=lambda s: (s.rows, -s.tokens)):
            if not frontier or s.tokens > frontier[-1].tokens + 1e-12:
                frontier.append(s)
        return frontier


def _tree(acceptance: float, widths: Sequence[int]) -> tuple[int, float]:
    """(target rows, expected tokens a round appends) of a tree with ``widths`` children per node by
    depth: a depth is accepted when one of its ``w`` candidates is the target's token, taken as
    ``1 - (1 - a)^w`` (a chain, ``w = 1``: Leviathan's ``(1 - a^(k+1)) / (1 - a)``)."""
    a = min(max(acceptance, 0.0), 0.999)
    rows, level, tokens, reach = 1, 1, 1.0, 1.0
    for w in widths:
        level *= w
        rows += level
        reach *= 1 - (1 - a) ** w
        tokens += reach
    return rows, tokens


def strategy_rows(strategy: Strategy) -> Callable[[int], int]:
    """Target rows of ``strategy``'s draft cut to length ``k``: ``1 + k`` for a chain, a tree's
    nodes down to depth ``k`` plus one."""
    widths = strategy.tree_widths
    if not strategy.speculates or not widths:
        return lambda k: 1 + k

    def rows(k: int) -> int:
        total, level = 1, 1
        for w in widths[:k]:
            level *= w
            total += level
        return total

    return rows


def expected_tokens(acceptance: float, length: int) -> float:
    """Tokens a round appends with a chain of ``length`` drafts at per-token ``acceptance``."""
    a = min(max(acceptance, 0.0), 0.999)
    return (1 - a ** (length + 1)) / (1 - a)


def acceptance_estimate(prior: float | None, accepted: int, drafted: int) -> float:
    """The route's acceptance as a prior of ``PRIOR_DRAFTS`` drafts, updated by the sequence's own."""
    p = DEFAULT_ACCEPTANCE if prior is None else prior
    return (p * PRIOR_DRAFTS + accepted) / (PRIOR_DRAFTS + drafted)


class RouteAcceptance:
    """Each route's live acceptance, per strategy: an exponentially weighted ratio of the accepted
    to the drafted tokens of its finished requests (each request's counts weigh ``weight`` against
    all before it, so a request that drafted little moves the ratio little). ``get`` is None until
    ``min_drafts`` tokens were drafted in all: until then the stored figure, measured when the
    strategy was tuned on other prompts, stands. Bounded: the ``max_keys`` (route, strategy) pairs
    seen last."""

    def __init__(self, weight: float = ROUTE_EWMA, min_drafts: int = ROUTE_MIN_DRAFTS, max_keys: int = 256) -> None:
        if not 0.0 < weight <= 1.0:
            raise ValueError(f"route acceptance weight must be in (0, 1], got {weight}")
        self.weight, self.min_drafts, self.max_keys = weight, min_drafts, max_keys
        # (route, strategy) -> (weighted accepted, weighted drafted, drafted in all)
        self._sums: OrderedDict[tuple[str, Strategy], tuple[float, float, int]] = OrderedDict()
        self._published: dict[str, dict[str, float]] = {}  # ``describe``'s answer, replaced whole on each change

    def observe(self, route: str, strategy: Strategy, accepted: int, drafted: int) -> None:
        if drafted <= 0:
            return
        key, w = (route, strategy), self.weight
        a, d, n = self._sums.get(key, (0.0, 0.0, 0))
        self._sums[key] = ((1 - w) * a + w * accepted, (1 - w) * d + w * drafted, n + drafted)
        self._sums.move_to_end(key)
        while len(self._sums) > self.max_keys:
            self._sums.popitem(last=False)
        published: dict[str, dict[str, float]] = {}  # once per finished request, at most ``max_keys`` pairs
        for r, s in self._sums:
            if (figure := self.get(r, s)) is not None:
                published.setdefault(r, {})[s.to_json()] = round(figure, 4)
        self._published = published

    def get(self, route: str, strategy: Strategy) -> float | None:
        a, d, n = self._sums.get((route, strategy), (0.0, 0.0, 0))
        return a / d if n >= self.min_drafts else None

    def describe(self) -> dict[str, dict[str, float]]:
        """Route -> {strategy (JSON) -> live acceptance}, for the pairs with a figure: a snapshot the
        writer (the decode thread) publishes, so ``/health`` never reads the live state."""
        return self._published


class StepCost:
    """Seconds of a batched target forward: a rising piecewise-linear function of its rows, with
    knots at the profiled row counts (one sequence of that many rows), plus a price per further
    sequence (each attends apart). A CPU's float32 step is flat for its first rows and linear
    after, which one line through every shape cannot follow (it prices the first rows' flat part as
    paid). Fitted by non-negative least squares (knot values that never fall, a sequence's price
    >= 0) over the start-up profile and the last real steps."""

    def __init__(self, profile: Sequence[tuple[int, int, float]] = ()) -> None:
        self.profile = list(profile)  # (rows, sequences, seconds) timed at start-up
        self.steps: deque[tuple[int, int, float]] = deque(maxlen=STEPS_KEPT)
        self.knots = np.array([1.0])  # row counts
        self.values = np.array([0.0])  # seconds of one sequence of each knot's rows
        self.per_seq = 0.0  # seconds each further sequence adds
        self._knots, self._values = [1.0], [0.0]
        self._fit()

    def observe(self, rows: int, sequences: int, seconds: float) -> None:
        self.steps.append((rows, sequences, seconds))
        if len(self.steps) % 16 == 0:
            self._fit()

    def predict(self, rows: int, sequences: int) -> float:
        """Called for every option the goodput choice weighs, each step: plain Python on the fitted
        knots (the weights of ``_row_weights`` for one row count), not arrays."""
        knots, values = self._knots, self._values
        if len(knots) == 1:
            one = values[0]
        else:
            at = min(max(bisect_right(knots, rows) - 1, 0), len(knots) - 2)
            t = max((rows - knots[at]) / (knots[at + 1] - knots[at]), 0.0)  # > 1 past the last knot
            one = values[at] + t * (values[at + 1] - values[at])
        return one + self.per_seq * max(sequences - 1, 0)

    def _fit(self) -> None:
        data = self.profile + list(self.steps)
        if not data:
            return
        knots = np.unique(np.array([float(r) for r, _, _ in (self.profile or data)]))
        rows = np.array([float(r) for r, _, _ in data])
        # knot j's value is the sum of non-negative rises 0..j: the fitted cost never falls with rows
        rises = np.cumsum(_row_weights(rows, knots)[:, ::-1], axis=1)[:, ::-1]
        x = np.column_stack([rises, [max(s - 1, 0) for _, s, _ in data]])
        y = np.array([t for *_, t in data])
        coef, _ = nnls(x, y)
        self.knots, self.values, self.per_seq = knots, np.cumsum(coef[:-1]), float(coef[-1])
        self._knots, self._values = self.knots.tolist(), self.values.tolist()


class CatchUpCost:
    """Seconds of a drafting model's catch-up over ``n`` tokens (a request's prompt and first
    tokens): ``fixed + per_token * n``, non-negative least squares over the last catch-ups seen.
    A forward has a price of its own whatever its length, so a rate per token taken from a short
    prompt prices a long one several times too high (and one taken from a long prompt, a short one
    too low); with one length seen the rate is its seconds per token."""

    def __init__(self) -> None:
        self.seen: deque[tuple[int, float]] = deque(maxlen=CATCH_UPS_KEPT)
        self.coef = np.zeros(2)

    def observe(self, tokens: int, seconds: float) -> None:
        self.seen.append((max(tokens, 1), seconds))
        if len({n for n, _ in self.seen}) < 2:
            self.coef = np.array([0.0, sum(t for _, t in self.seen) / sum(n for n, _ in self.seen)])
        else:
            self.coef, _ = nnls(np.array([[1.0, n] for n, _ in self.seen]), np.array([t for _, t in self.seen]))

    def predict(self, tokens: int) -> float:
        return float(self.coef @ np.array([1.0, tokens])) if self.seen else 0.0


class DraftCost:
    """Seconds of a draft model's drafting in a batched step: every depth is one forward over the
    sequences still drafting there (``runtime.batching.draft_together``), so a phase of ``depths``
    forwards that drafted ``drafts`` tokens in all costs ``fixed * depths + per_seq * drafts``.
    Priced per sequence alone (a lone request's seconds per drafted token), a depth for 4 sequences
    would cost 4 forwards where it runs one. Fitted by non-negative least squares over
    the start-up profile (one depth forward per batch size) and the latest real drafting phases;
    ``known`` once they tell the two prices apart (two batch sizes seen)."""

    def __init__(self, profile: Sequence[tuple[int, float]] = ()) -> None:
        self.profile = [(1, m, t) for m, t in profile]  # (depths, drafts, seconds): one forward of m sequences
        self.steps: deque[tuple[int, int, float]] = deque(maxlen=DRAFT_STEPS_KEPT)
        self.fixed = self.per_seq = 0.0
        self.known = False
        self._fit()

    def observe(self, depths: int, drafts: int, seconds: float) -> None:
        if depths >= 1 and drafts >= depths and seconds > 0:
            self.steps.append((depths, drafts, seconds))
            if len(self.steps) % 8 == 0 or not self.known:
                self._fit()

    def forward_s(self, sequences: int) -> float:
        """One depth forward for ``sequences`` sequences."""
        return self.fixed + self.per_seq * sequences

    def _fit(self) -> None:
        data = self.profile + list(self.steps)
        self.known = len({d / n for n, d, _ in data}) >= 2  # sequences per forward: two sizes at least
        if not self.known:
            return
        coef, _ = nnls(np.array([[float(n), float(d)] for n, d, _ in data]), np.array([t for *_, t in data]))
        self.fixed, self.per_seq = float(coef[0]), float(coef[1])


def _row_weights(rows: np.ndarray, knots: np.ndarray) -> np.ndarray:
    """Linear-interpolation weights of each row count on the knots (n x knots): constant below the
    first knot, the last segment's slope carried on past the last."""
    w = np.zeros((len(rows), len(knots)))
    if len(knots) == 1:
        w[:, 0] = 1.0
        return w
    at = np.clip(np.searchsorted(knots, rows, side="right") - 1, 0, len(knots) - 2)
    lo, hi = knots[at], knots[at + 1]
    t = np.maximum((rows - lo) / (hi - lo), 0.0)  # > 1 past the last knot: extrapolated
    w[np.arange(len(rows)), at] = 1.0 - t
    w[np.arange(len(rows)), at + 1] = t
    return w


def choose_shapes(candidates: Sequence[Candidate], cost: StepCost, max_rows: int | None = None) -> list[Shape]:
    """Each candidate's draft this step, maximising expected tokens per second over the batch:
    drafts grow one option at a time (a token longer, or a tree a child wider), the most profitable
    move first, while the goodput rises and the step's rows stay within ``max_rows``. A move is one
    candidate's next option, or every candidate of a ``draft_group`` one option further together:
    their depth forward's own price (``draft_fixed_s``) is paid once for all of them, so a single
    candidate's first depth may not pay where the group's does."""
    options = [c.shapes() for c in candidates]
    at = [0] * len(candidates)  # every candidate starts at no draft (1 row, 1 token)
    groups: dict[str, list[int]] = {}
    for j, c in enumerate(candidates):
        if c.draft_group is not None:
            groups.setdefault(c.draft_group, []).append(j)
    moves = [[j] for j in range(len(candidates))] + [g for g in groups.values() if len(g) > 1]

    def goodput(idx: list[int]) -> float:
        chosen = [o[i] for o, i in zip(options, idx)]
        seconds = cost.predict(sum(s.rows for s in chosen), len(idx))
        shared: dict[str, float] = {}
        for c, s in zip(candidates, chosen):
            seconds += c.draft_token_s * s.length + (c.start_share(s.tokens) if s.length else 0.0)
            if c.draft_group is None:
                seconds += c.draft_fixed_s * s.length
            else:  # one forward per depth for the whole group: its deepest draft's depths
                shared[c.draft_group] = max(shared.get(c.draft_group, 0.0), c.draft_fixed_s * s.length)
        seconds += sum(shared.values())
        return sum(s.tokens for s in chosen) / max(seconds, 1e-9)

    best = goodput(at)
    while True:
        rows = sum(o[i].rows for o, i in zip(options, at))
        gains = []
        for move in moves:
            step = [j for j in move if at[j] + 1 < len(options[j])]
            if not step:
                continue
            added = sum(options[j][at[j] + 1].rows - options[j][at[j]].rows for j in step)
            if max_rows is not None and rows + added > max_rows:
                continue
            trial = at.copy()
            for j in step:
                trial[j] += 1
            gains.append((goodput(trial), len(step), trial))
        if not gains:
            break
        value, _, trial = max(gains, key=lambda g: (g[0], -g[1]))  # a tie goes to the smaller move
        if value <= best:
            break
        best, at = value, trial
    return [o[i] for o, i in zip(options, at)]


def starts_alone(candidate: Candidate, cost: StepCost) -> bool:
    """Whether a sequence decoding alone should start drafting with its strategy's draft: false only
    when its catch-up (``start_s``) exceeds the most that drafting could save over the tokens it has
    left (each round's expected tokens for one plain step, drafting and verifying taken as free). Short
    of that bound a sequence alone runs its tuned strategy as it is: the step cost is fitted on
    batched steps, and alone the tuned strategy's own measurements speak for it."""
    if candidate.start_s <= 0 or candidate.max_length < 1:
        return True
    tokens = candidate.shapes()[-1].tokens
    most_saved = candidate.remaining * cost.predict(1, 1) * (1 - 1 / max(tokens, 1.0))
    return candidate.start_s < most_saved


def pays_alone(candidate: Candidate, verify_s: Callable[[int], float], plain_s: float,
               stops_early: bool = False, margin: float = 0.0) -> bool:
    """Whether a sequence decoding alone with the candidate's draft is expected to beat plain
    decoding by more than ``margin`` (a share): a round's expected tokens over its drafting and its
    verify of the draft's rows, against one token per ``plain_s``. The whole draft is judged, or,
    for a chain that stops at its first unsure token (``stops_early``: SWIFT's confidence-aware
    drafting), the length up to its cap that pays best: such a chain does not run its cap where its
    drafts stop being accepted."""
    if candidate.max_length < 1:
        return False
    shapes = candidate.shapes() if stops_early else candidate.shapes()[-1:]
    return any(speed_up > 1.0 + margin for _, speed_up in alone_speed_ups(candidate, verify_s, plain_s, shapes))


def alone_speed_ups(candidate: Candidate, verify_s: Callable[[int], float], plain_s: float,
                    shapes: Sequence[Shape] | None = None) -> list[tuple[int, float]]:
    """(draft length, expected speed against plain steps) of each of ``shapes`` (default: every
    one the candidate may run) decoding alone: a round's expected tokens in plain steps over its
    drafting and its verify of the draft's rows (``pays_alone``'s price; inf where a round is free)."""
    out = []
    for s in candidate.shapes() if shapes is None else shapes:
        if s.length:
            round_s = candidate.draft_token_s * s.length + verify_s(s.rows)
            out.append((s.length, s.tokens * plain_s / round_s if round_s > 0 else float("inf")))
    return out


def choose_lengths(candidates: Sequence[Candidate], cost: StepCost, max_rows: int | None = None) -> list[int]:
    """Each candidate's draft length this step (:func:`choose_shapes`)."""
    return [s.length for s in choose_shapes(candidates, cost, max_rows)]


SCHEDULE_BATCHES = (1, 2, 4, 8, 16, 32, 64)  # batch sizes a vLLM schedule is derived at


def batch_schedule(acceptance: float, max_length: int, cost: StepCost, draft_step_s: Callable[[int], float],
                   rows: Callable[[int], int] = lambda k: 1 + k,
                   batches: Sequence[int] = SCHEDULE_BATCHES) -> dict[str, int]:
    """vLLM's ``num_speculative_tokens_per_batch_size``: the draft length :func:`choose_lengths`
    gives a batch of ``b`` like sequences, as inclusive batch-size ranges (``{"1-3": 4, ...}``;
    the last range covers the largest batch measured, and vLLM carries it on to larger ones).
    ``draft_step_s(b)``: one draft depth for ``b`` sequences (drafted together)."""
    chosen = []
    for b in batches:
        per_token = draft_step_s(b) / b  # each sequence's share of a depth drafted for the batch
        ks = choose_lengths([Candidate(acceptance, max_length, per_token, rows)] * b, cost)
        chosen.append((b, round(sum(ks) / len(ks))))
    schedule: dict[str, int] = {}
    start = 1
    for i, (b, k) in enumerate(chosen):
        last = i + 1 == len(chosen)
        if last or chosen[i + 1][1] != k:
            end = b if last else chosen[i + 1][0] - 1
            schedule[f"{start}-{end}"] = k
            start = end + 1
    return schedule
