"""Racing and probation: how the online tuner (``autotune.tuning.tuner``) switches strategies.

A candidate predicted ``switch_margin`` faster than the incumbent *on the same window* joins the
race (``Race.join``; the best ``RACE_SIZE`` stay). Each time ``window`` new tokens have been
decoded, the incumbent and the racers are re-scored on the fresh window (``Race.rescore``); a
racer that no longer wins drops out. Then the free families are **swept** (``Race.sweep``): the
draft model's all-layer plan (scored by its catch-up forward), prompt lookup and the incumbent's
plan are scored at every point of their grids (``SearchSpace.sweep``: lengths x thresholds x tree
heads x ``lookup_first``) - arithmetic on the window's cached matches - and the best few predicted
``switch_margin`` faster join the race. One that won on ``race_windows`` further windows decodes
for ``confirm_tokens`` tokens (a measured trial, ``Race.measure_best``) and replaces the
incumbent only if it measured faster than the incumbent would have on the same tokens (plain
decoding's measured speed; a speculating incumbent's corrected prediction on that window) and
than the incumbent's own latest rounds (``Race.decide``); otherwise decoding goes back to the
incumbent. A decision needs a prediction that survived fresh data and a measurement, so one lucky
window never switches (a racer priced far above the incumbent is measured at once, ``Race.rushes``,
until a rushed trial of its drafter kind lost to that incumbent). The candidate scored nearest the
incumbent since it took over or since its last rival measurement (``Race.note``), if within a
margin of it, is measured (``Race.measure_rival``) before the tuner stops on predictions alone,
and when predictions alone have ruled for a while: a standing incumbent rests on measurements of
its nearest rival too. A kept strategy stays on probation (``Race.probation``): once it decoded
``probation_tokens`` and measured more than ``switch_margin`` slower, over everything it decoded,
than the incumbent it replaced, decoding reverts to that one (measured data only, no cost).

Every measured stretch of a strategy adds to its correction ``measured / predicted`` tokens/s
(``Race.correct``; ``autotune.tuning.corrections``, the scheme the request controller shares), so
predictions converge to measurements.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from autotune.tuning.corrections import Corrections
from autotune.tuning.cost_model import CostModel
from runtime.decoding import Decoder
from runtime.stats import DecodeStats
from search_spaces.spaces import SearchSpace, SpaceContext
from search_spaces.strategy import PLAIN, Strategy

RACE_SIZE = 4  # racers kept (the best predicted)
RECENT_ROUNDS = 48  # an incumbent's measured speed: its latest rounds (the context grows as it decodes)

Score = tuple[float, float, float]  # (corrected tokens/s, raw predicted tokens/s, matchness) on a window
ScoreFn = Callable[[Decoder, Strategy, list[int]], "Score | None"]  # None: its drafter cannot score there
TellFn = Callable[[Strategy, float, float, float], int]  # (strategy, score, raw, matchness) -> trial number


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
    rushed: bool = False  # its measured trial started on one window's price alone (``Race.rushes``)
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT_ROUNDS))  # (tokens, seconds) per round
    corrected: tuple[int, float, int] = (0, 0, 0)  # tokens, seconds and raws already given to the corrections

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


@dataclass(frozen=True, slots=True)
class RoundMark:
    """The decoder's counters at the end of a round: the next round is measured from them (and
    attributed to the strategy that decoded it)."""

    tokens: int  # sequence length
    forwards: int  # target forwards
    draft_rounds: int
    verify_s: float
    clock: float  # when it ended, moved on by the tuning time spent after it (not decode time)
    drafted: int
    accepted: int

    @classmethod
    def of(cls, tokens: int, stats: DecodeStats, clock: float) -> RoundMark:
        return cls(tokens, stats.target_forwards, stats.draft_rounds, stats.verify_s, clock, stats.drafted,
                   stats.accepted)

    def step_since(self, last: RoundMark) -> tuple[float, float | None] | None:
        """The target's seconds per step since ``last`` and its rows (1 + the tokens drafted per
        round: what a verify that does not pad runs; None: plain steps), or None when none ran."""
        steps = self.forwards - last.forwards
        if steps <= 0 or self.verify_s <= last.verify_s:
            return None
        rounds = self.draft_rounds - last.draft_rounds
        rows = 1.0 + (self.drafted - last.drafted) / rounds if rounds > 0 else None
        return (self.verify_s - last.verify_s) / steps, rows

    def observe(self, last: RoundMark, cost: CostModel) -> None:
        """Refresh ``cost`` with the target step since ``last``: a verify of its rows when the
        round drafted, else a plain step (``step_since``)."""
        step = self.step_since(last)
        if step is None:
            return
        seconds, rows = step
        if rows is not None:
            cost.observe_verify(seconds, rows)
        else:
            cost.observe_plain(seconds)


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


@dataclass(frozen=True)
class Closest:
    """The candidate scored nearest the incumbent ``of`` since it took over or its last rival was
    measured: ``share`` is its score over the incumbent's on the same window."""

    racer: Racer
    share: float
    of: Strategy


class Families:
    """The free families, swept on every fresh window: the seeds whose score on a fresh window
    costs no forward of their own (prompt lookup; a draft's all-layer plan, scored by its catch-up
    forward), so one unrepresentative window does not rule a kind of drafter out, and lengths,
    thresholds and tree heads are compared where it costs nothing; and the incumbent's (scored on
    the window anyway)."""

    def __init__(self, space: SearchSpace, ctx: SpaceContext, seeds: list[Strategy]) -> None:
        self.space, self.ctx = space, ctx
        self.free = [s for s in seeds if s.speculates and (s.layer_plan is None or s.layer_plan.is_identity)]
        self._grids: dict[tuple[str, Any], list[Strategy]] = {}  # (drafter, plan) -> its sweep grid

    def family(self, strategy: Strategy) -> list[Strategy]:
        """``strategy``'s sweep grid (``SearchSpace.sweep``), built once per drafter and plan."""
        plan = strategy.layer_plan
        key = (strategy.drafter, None if plan is None or plan.is_identity else plan)
        if key not in self._grids:
            self._grids[key] = self.space.sweep(strategy, self.ctx)
        return self._grids[key]

    def points(self, incumbent: Strategy) -> dict[Strategy, None]:
        """Every point of the free families' grids and of ``incumbent``'s, in order."""
        points: dict[Strategy, None] = dict.fromkeys(self.free)  # the seeds too (a cut tree is off the grid)
        for base in [*self.free, incumbent]:
            points.update(dict.fromkeys(self.family(base)))
        return points


class Race:
    """The incumbent, the racers, the measured trials and their outcomes, and the per-strategy
    corrections learnt from what decoding measured."""

    def __init__(self, switch_margin: float, race_windows: int, probation_tokens: int) -> None:
        self.switch_margin, self.race_windows, self.probation_tokens = switch_margin, race_windows, probation_tokens
        self.incumbent = Kept(PLAIN, trial=-1, predicted_tps=0.0, matchness=0.0)
        self.kept: list[Kept] = [self.incumbent]
        self.challenger: Kept | None = None  # a racer decoding for its measured trial
        self.race: dict[Strategy, Racer] = {}
        self.switches: list[int] = []  # trial numbers of the strategies that replaced the incumbent
        self.rejected: list[Kept] = []  # measured trials that lost to the incumbent
        self.reverted: list[Kept] = []  # kept strategies that then measured slower than what they replaced
        self.corrections = Corrections()
        self.closest: Closest | None = None  # nearest the incumbent lately (``note``)
        self.rush_lost: set[str] = set()  # drafter kinds whose rushed trial lost to the incumbent (``rushes``)

    @property
    def running(self) -> Kept:
        """What decodes now: the challenger during its measured trial, else the incumbent."""
        return self.challenger or self.incumbent

    @property
    def decoding(self) -> set[Strategy]:
        """The strategies that cannot join the race: the incumbent and the challenger."""
        return {self.incumbent.strategy} | ({self.challenger.strategy} if self.challenger else set())

    def beats(self, score: float, incumbent: float) -> bool:
        """Whether ``score`` is ``switch_margin`` above the incumbent's on the same window."""
        return score > incumbent * (1.0 + self.switch_margin)

    def account(self, last: RoundMark, now: RoundMark) -> None:
        """Attribute the round decoded between ``last`` and ``now`` to the running strategy."""
        new, secs = now.tokens - last.tokens, now.clock - last.clock
        run = self.running
        run.tokens += new
        run.seconds += secs
        run.drafted += now.drafted - last.drafted
        run.accepted += now.accepted - last.accepted
        if new > 0:
            run.recent.append((new, secs))

    # ----------------------------------------------------------------- racing
    def join(self, strategy: Strategy, trial: int, score: float, raw: float, rate: float, incumbent: float) -> bool:
        """Enter ``strategy`` in the race when it scored ``switch_margin`` above the incumbent."""
        if strategy in self.decoding or not self.beats(score, incumbent):
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

    def rescore(self, decoder: Decoder, tokens: list[int], incumbent: float, score: ScoreFn) -> list[Racer]:
        """Re-score the racers on a fresh window (the incumbent scored ``incumbent`` there); a
        racer that no longer wins drops out. -> the survivors."""
        survivors = []
        for racer in list(self.race.values()):
            got = score(decoder, racer.strategy, tokens)
            if got is not None:
                self.note(racer.strategy, got, incumbent, racer.trial)
            if got is None or not self.beats(got[0], incumbent):
                del self.race[racer.strategy]
                continue
            racer.score, racer.raw, racer.matchness = got
            racer.raws.append(racer.raw)
            racer.wins += 1
            survivors.append(racer)
        return survivors

    def measure_best(self, decoder: Decoder, survivors: Iterable[Racer], incumbent: float | None = None,
                     rush: float | None = None) -> bool:
        """Start a measured trial for the best racer that won ``race_windows`` fresh windows, or
        at once for one scored ``rush`` (a share) above the ``incumbent``'s score on the same
        window: a candidate priced that far ahead is measured now, not a window later (the
        measurement still decides). It decodes as the challenger. A survivor no longer in the race
        (pushed out by better-priced joiners since it survived) is not measured. -> whether one started."""
        ready = [r for r in survivors if self.race.get(r.strategy) is r
                 and (r.wins >= self.race_windows or self.rushes(r, incumbent, rush))]
        if not ready:
            return False
        racer = max(ready, key=lambda r: r.score)
        rushed = racer.wins < self.race_windows
        del self.race[racer.strategy]
        if self.closest is not None and self.closest.racer.strategy == racer.strategy:
            self.closest = None  # measured now: its next rival measurement is another's
        self.challenger = Kept(racer.strategy, racer.trial, racer.score, racer.matchness, raw_tps=racer.raw,
                               raws=list(racer.raws), rushed=rushed)
        decoder.apply(racer.strategy)
        return True

    def rushes(self, racer: Racer, incumbent: float | None, rush: float | None) -> bool:
        """Whether ``racer`` scored ``rush`` (a share) above the ``incumbent``'s score: measured at
        once. Not once a rushed trial of its drafter kind lost to this incumbent: one window's
        price already misled about that kind on this text (a window that copies, then text that
        does not), so its candidates win a fresh window first, as every racer does."""
        return rush is not None and incumbent is not None and racer.strategy.drafter not in self.rush_lost \
            and racer.score > incumbent * (1.0 + rush)

    def sweep(self, decoder: Decoder, tokens: list[int], incumbent: float, points: Iterable[Strategy],
              score: ScoreFn, tell: TellFn) -> tuple[list[Racer], int]:
        """Score ``points`` (the free families' grids) on the window; the best few predicted
        ``switch_margin`` above the incumbent join the race, each told to the study as a trial
        (``tell`` -> its number). -> (the racers that joined, the points scored)."""
        decoding = self.decoding
        scored, swept = [], 0
        for s in points:
            if s in self.race or s in decoding:
                continue
            got = score(decoder, s, tokens)
            if got is None:
                continue
            swept += 1
            self.note(s, got, incumbent)
            if self.beats(got[0], incumbent):
                scored.append((got, s))
        joined = []
        # ties go to the longer draft (at one verify width, no slower where predictions agree)
        for (value, raw, rate), s in sorted(scored, key=lambda x: (-x[0][0], -x[1].draft_length))[:RACE_SIZE]:
            trial = tell(s, value, raw, rate)
            if self.join(s, trial, value, raw, rate, incumbent) and s in self.race:
                joined.append(self.race[s])
        return joined, swept

    # ----------------------------------------------------------------- the closest rival
    def note(self, strategy: Strategy, got: Score, incumbent: float, trial: int | None = None) -> None:
        """Remember ``strategy`` (scored ``got`` on a window where the incumbent scored
        ``incumbent``; ``trial``: its number when the study was told it) if it came nearer the
        incumbent than any candidate since the incumbent took over or its last rival was measured
        (a share of its score)."""
        if strategy in self.decoding or incumbent <= 0:
            return
        share = got[0] / incumbent
        c = self.closest
        if c is not None and c.of == self.incumbent.strategy and share <= c.share:
            return
        self.closest = Closest(Racer(strategy, -1 if trial is None else trial, got[0], got[1], got[2],
                                     raws=[got[1]]), share, self.incumbent.strategy)

    def measure_rival(self, decoder: Decoder, margin: float | None, tell: TellFn) -> bool:
        """Start a measured trial for the closest rival of the incumbent (``note``) when it scored
        within ``margin`` (a share) below the incumbent on its window (None: never); ``note``
        then starts afresh. Its prediction alone may be off where its correction never saw it decode;
        the measurement decides as any measured trial does (``decide``). A rival the study was not
        told of (a swept point that did not join the race) is told first (``tell``). -> whether
        one started."""
        c = self.closest
        # ``note`` kept no decoding strategy, and ``of`` is still the incumbent: the rival is not decoding
        if margin is None or c is None or c.of != self.incumbent.strategy or self.challenger is not None \
                or c.racer.strategy in self.race or c.share < 1.0 - margin:
            return False
        self.closest = None
        r = c.racer
        trial = r.trial if r.trial >= 0 else tell(r.strategy, r.score, r.raw, r.matchness)
        self.challenger = Kept(r.strategy, trial, r.score, r.matchness, raw_tps=r.raw, raws=list(r.raws))
        decoder.apply(r.strategy)
        return True

    # ----------------------------------------------------------------- decisions
    def decide(self, decoder: Decoder, challenger: Kept, same_text: float | None) -> bool:
        """End a measured trial: the challenger replaces the incumbent if it decoded faster than
        the incumbent would have on the same tokens - plain decoding's measured speed, or a
        speculating incumbent's corrected prediction on the window the challenger just decoded
        (``same_text``) - and than the incumbent's own measured speed over its latest rounds;
        otherwise decoding goes back to the incumbent. -> whether it replaced the incumbent."""
        inc = self.incumbent
        # and not slower than the incumbent measured lately: how fast a drafter goes depends on
        # the text (prompt lookup flies where a completion copies its prompt), so a switch must
        # win on the same text and against what the incumbent has been doing
        bar = max(same_text or 0.0, inc.recent_tps or inc.predicted_tps)
        challenger.bar_tps = bar
        if (challenger.measured_tps or 0.0) > bar:
            challenger.replaced = inc
            self.incumbent = challenger
            self.rush_lost.clear()
            self.kept.append(challenger)
            self.switches.append(challenger.trial)
            return True
        self.rejected.append(challenger)
        if challenger.rushed:
            self.rush_lost.add(challenger.strategy.drafter)
        decoder.apply(inc.strategy)
        return False

    def probation(self, decoder: Decoder) -> bool:
        """Revert a kept strategy that, over ``probation_tokens`` or more, measured more than
        ``switch_margin`` slower than the incumbent it replaced (measured data only: costs
        nothing). The two speeds come from different stretches of text, so a smaller gap is
        noise, not a verdict: the kept strategy won its measured trial on the same tokens.
        -> whether it reverted."""
        inc = self.incumbent
        prev = inc.replaced
        if prev is None or self.challenger is not None or inc.tokens < self.probation_tokens:
            return False
        if (inc.measured_tps or 0.0) >= (prev.measured_tps or 0.0) * (1.0 - self.switch_margin):
            return False
        inc.bar_tps = prev.measured_tps
        self.reverted.append(inc)
        self.incumbent = prev
        self.rush_lost.clear()
        self.switches.append(prev.trial)
        decoder.apply(prev.strategy)
        return True

    # ----------------------------------------------------------------- corrections
    def correction(self, strategy: Strategy) -> float:
        """Measured / predicted tokens/s of ``strategy`` (``Corrections.factor``)."""
        return self.corrections.factor(strategy)

    def correct(self, kept: Kept) -> None:
        """Give the corrections what ``kept`` decoded since it last did, with its uncorrected
        predictions on the windows it raced and decoded since then (its first stretch: every one)."""
        tokens, seconds, raws = kept.corrected
        if kept.tokens <= tokens or kept.seconds <= seconds or len(kept.raws) <= raws:
            return  # nothing new decoded, or no prediction made for it since
        self.corrections.observe(kept.strategy, kept.raws[raws:], kept.tokens - tokens, kept.seconds - seconds)
        kept.corrected = (kept.tokens, kept.seconds, len(kept.raws))

    # ----------------------------------------------------------------- results
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

    def summary(self) -> dict[str, Any]:
        """The measured trials that lost, the switches, the reverted and the kept strategies
        (predicted against measured: the incumbent's prediction is its corrected one)."""
        kept = []
        for k in self.kept:
            predicted = self.predicted_tps(k.strategy) if k is self.incumbent else k.predicted_tps
            measured = k.measured_tps
            kept.append({
                "trial": k.trial, "strategy": k.strategy.to_dict(), "predicted_tps": predicted,
                "measured_tps": measured, "matchness": k.matchness, "tokens": k.tokens, "acceptance": k.acceptance,
                "bar_tps": k.bar_tps, "rushed": k.rushed,
                "ratio": predicted / measured if predicted and measured else None,
            })
        return {
            "rejected": [
                {"trial": k.trial, "strategy": k.strategy.to_dict(), "predicted_tps": k.predicted_tps,
                 "measured_tps": k.measured_tps, "incumbent_tps": k.bar_tps, "rushed": k.rushed}
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
