"""The online tuner (SWIFT 4.1), ask-and-tell with Optuna, safe to run on live traffic.

Plain decoding is a point of every space and the incumbent until a candidate beats it on
measured time. While decoding goes on with the incumbent, before rounds the tuner:

1. **Scores candidates** (``_trial``): asks the study (``autotune.tuning.trials``) - first the
   space's seeds (one reference point per drafter kind), then the incumbent's neighbours
   (``SearchSpace.neighbours``: length +-2, threshold +-0.1, enqueued at each window; they reuse
   the window's matchness, so they cost almost nothing), otherwise random search, and every
   ``beta``-th sampled trial a Bayesian sampler - predicts the candidate's tokens/s on the latest window
   scored (``autotune.tuning.scoring``) times the strategy's correction (below), and tells the
   study. A candidate predicted ``switch_margin`` faster than the incumbent *on the same window*
   joins the race.
2. **Races** (``_new_window``; ``autotune.tuning.race``): each ``window`` fresh tokens, the
   incumbent and the racers are re-scored and the free families' grids swept (arithmetic on the
   window's cached matches). A racer that kept winning on ``race_windows`` further windows (or
   at once, one priced ``rush_margin`` above the incumbent) decodes
   ``confirm_tokens`` tokens (a measured trial) and replaces the incumbent only if it measured
   faster than the incumbent on the same tokens and lately, so one lucky window never switches; a
   kept strategy stays on probation (reverted if it measures ``switch_margin`` slower than the
   incumbent it replaced).
3. **Corrects the cost model per strategy**: every measured stretch of a strategy adds to its
   correction ``measured / predicted`` tokens/s (``autotune.tuning.corrections``, the scheme the
   request controller shares), so predictions converge to measurements; ``summary()`` reports
   the ratio for every kept strategy.
4. **Spends little** (``autotune.tuning.budget``): tuning time is an allowance accruing at
   ``max_share`` of decode time, divided by 1 + the windows in a row the incumbent has led, and
   tuning spends it; the cost model's timing is a one-time cost of the models on this machine
   (kept in the store, ``calibration_s``), reported apart and not spent from it; after ``stop_windows`` such
   windows (a sign test at p = 0.5^stop_windows) and ``min_trials`` trials it stops trials, and
   watches: fresh windows are still scored (cheaply), and a candidate beating the incumbent there
   resumes tuning. Before it stops, and whenever ``stop_windows`` windows passed with no measured
   trial, the incumbent's closest rival since it took over (or since the last such measurement),
   if scored within ``rival_margin`` of it, decodes a measured trial (``Race.measure_rival``): a
   stop, and an incumbent standing unchallenged, rest on measurements, not on predictions alone.
   Trials go to an in-memory study, copied to the persistent one at the end of each prompt
   (``flush``; a study copies them once, after its last prompt).

The decoder switches strategies through ``Decoder.apply``: every drafter kind of the space is on
the decoder (drafting or on standby, following the sequence), so a switch keeps all state.
With ``max_share`` below 1 the trials depend on timings; decisions depend on measured time,
which ``clock`` reads (tests pass a deterministic clock).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import optuna

from autotune.tuning.budget import Budget
from autotune.tuning.cost_model import CostModel
from autotune.tuning.objective import predict_plain, replay_lookup
from autotune.tuning.race import Families, Kept, Race, Racer, RoundMark, Score
from autotune.tuning.scoring import Window
from autotune.tuning.trials import Trials, bayesian_sampler
from autotune.tuning.tuner_state import TunerSettings, TunerState
from runtime.decoding import Decoder
from runtime.kv_cache import KVCache
from runtime.stats import DecodeStats
from search_spaces.spaces import SearchSpace, SpaceContext
from search_spaces.strategy import PLAIN, Strategy

__all__ = ["Kept", "OnlineTuner", "Racer", "TunerSettings", "TunerState", "bayesian_sampler"]


class OnlineTuner:
    def __init__(self, space: SearchSpace, ctx: SpaceContext, study: optuna.Study, cost: CostModel,
                 settings: TunerSettings, initial: Strategy = PLAIN,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        """``study``: where trials are kept (``flush`` copies them there; an in-memory working
        study takes them while decoding). ``initial``: a strategy to try first (e.g. a resumed
        study's best): it is enqueued and must win its race like any candidate; decoding starts
        plain."""
        self.space, self.ctx, self.cost, self.settings, self.clock = space, ctx, cost, settings, clock
        self.trials = Trials(study, space, ctx, settings.seed, settings.beta)
        self.state = TunerState()
        self.racing = Race(settings.switch_margin, settings.race_windows, settings.probation_tokens)
        self.budget = Budget(settings.max_share, clock)
        self.window = Window(settings.window, ctx.max_draft_length, cost)  # the latest scored, its matches cached
        if settings.defer_catch_up:
            self.window.afford = self.budget.covers
        self._last: RoundMark | None = None
        self._prompt_start = 0
        self._applied = False
        self.decoded: list[tuple[int, list[int]]] = []  # (prompt length, prompt + output) of every prompt tuned on
        # tried first: a resumed study's best, then the space's seeds (one good point per drafter kind)
        seeds = [initial] + [s for s in space.seeds(ctx) if s != initial]
        for seed in seeds:
            self.trials.enqueue(seed)
        self.families = Families(space, ctx, seeds)  # swept on every fresh window

    @property
    def study(self) -> optuna.Study:
        """The working study (in memory; ``flush`` copies its trials to the persistent one)."""
        return self.trials.study

    # ----------------------------------------------------------------- the race (``Race``)
    @property
    def incumbent(self) -> Kept:
        return self.racing.incumbent

    @incumbent.setter
    def incumbent(self, kept: Kept) -> None:
        self.racing.incumbent = kept

    @property
    def challenger(self) -> Kept | None:
        """A racer decoding for its measured trial."""
        return self.racing.challenger

    @property
    def kept(self) -> list[Kept]:
        """Every strategy that decoded, in order (``Race.kept``)."""
        return self.racing.kept

    # ----------------------------------------------------------------- decode hooks
    def start_prompt(self, prompt_len: int) -> None:
        self._prompt_start = prompt_len
        self.window.new_prompt(prompt_len)
        self._last = None
        self.budget.resume()

    def end_prompt(self, tokens: list[int], stats: DecodeStats, flush: bool = True) -> None:
        """Attribute the prompt's last round to the running strategy, refresh the incumbent's
        correction with it, and persist the new trials (``flush=False``: the caller flushes later)."""
        self._account(tokens, stats)
        self._last = None
        self.decoded.append((self._prompt_start, list(tokens)))
        self.racing.correct(self.incumbent)
        t0 = self.clock()
        if flush:
            self.flush()
        now = self.clock()
        self.budget.pause(now)
        self._spend(now - t0)

    def before_round(self, decoder: Decoder, tokens: list[int], cache: KVCache, stats: DecodeStats) -> None:
        self._account(tokens, stats)
        if self.racing.probation(decoder):  # a kept strategy measured slower than the one it replaced
            self.state.stable = 0
        t0 = self.clock()
        # re-scoring less once the incumbent leads, after the tuner has explored ``min_trials``
        stable = self.state.stable if self.state.trials >= self.settings.min_trials else 0
        self.budget.accrue(t0, stable)
        if not self._applied:  # plain decoding until a candidate beats it on measured time
            decoder.apply(self.incumbent.strategy)
            self._applied = True
        timed = self._calibrated()
        try:
            self._tune(decoder, tokens, t0)
        finally:
            spent = self.clock() - t0
            # timing the cost model is a one-time cost of the models on this machine: reported apart
            once = min(max(self._calibrated() - timed, 0.0), spent)
            self.state.calibration_s += once
            self._spend(spent - once)
            if self._last is not None:  # tuning time is not decode time of the running strategy
                self._last = replace(self._last, clock=self._last.clock + spent)

    def _calibrated(self) -> float:
        """Seconds the cost model has spent timing forwards so far."""
        return float(getattr(self.cost, "calibration_s", 0.0))

    def _tune(self, decoder: Decoder, tokens: list[int], t0: float) -> None:
        """Before a round (tuning began at ``t0``): end a measured trial that decoded enough, then,
        budget permitting, score a fresh window and run up to ``trials_per_round`` trials."""
        ch = self.challenger
        if ch is not None and ch.tokens >= self.settings.confirm_tokens:
            self._decide(decoder, tokens)
        if self.challenger is not None or len(tokens) - self._prompt_start < self.settings.window:
            return
        if self.state.done and not self.racing.race and not self.state.watching:  # stopped, no racer left
            return
        if not self.budget.covers(0.0):
            self.state.skipped_for_budget += 1
            return
        if len(tokens) - self.window.at >= self.settings.window:  # fresh tokens: a window is cheap
            self._new_window(decoder, tokens)
        if self.state.done or not self.window.tokens:
            return
        # trials score on the latest window (its matches cached): a plan scored there costs no forward
        for _ in range(self.settings.trials_per_round):
            if self.state.done or self.challenger is not None or not self._trial(decoder, self.window.tokens) \
                    or not self.budget.covers(self.clock() - t0):
                break
        # a trial priced far above the incumbent races now (its measured trial decides)
        rush, bar = self.settings.rush_margin, self.state.best_score
        rushers = [r for r in self.racing.race.values() if self.racing.rushes(r, bar, rush)]
        if self.challenger is None and rushers and self.racing.measure_best(decoder, rushers, bar, rush):
            self.state.measured()

    def _spend(self, seconds: float) -> None:
        """Tuning time: reported, and spent from the allowance."""
        self.state.tuning_s += seconds
        self.budget.spend(seconds)

    def _account(self, tokens: list[int], stats: DecodeStats) -> None:
        """Attribute the round just decoded to the running strategy (``Race.account``) and refresh
        the cost model with its target step (``RoundMark.observe``)."""
        last, self._last = self._last, RoundMark.of(len(tokens), stats, self.clock())
        if last is not None:
            self.racing.account(last, self._last)
            self._last.observe(last, self.cost)

    # ----------------------------------------------------------------- scoring
    def score(self, decoder: Decoder, strategy: Strategy, tokens: list[int]) -> Score | None:
        """-> (corrected tokens/s, raw predicted tokens/s, matchness) of ``strategy`` on the
        latest window, or None when its drafter cannot score there."""
        got = self.window.predict(decoder, strategy, tokens)
        if got is None:
            return None
        prediction, rate = got
        raw = prediction.tokens_per_s
        return raw * self.correction(strategy), raw, rate

    def correction(self, strategy: Strategy) -> float:
        """Measured / predicted tokens/s of ``strategy`` (``Race.correction``)."""
        return self.racing.correction(strategy)

    def _incumbent_score(self, decoder: Decoder, tokens: list[int]) -> float | None:
        """The incumbent's score on the latest window: plain decoding's measured speed (its
        prediction before any plain round), a speculating incumbent's corrected prediction."""
        inc = self.incumbent
        if not inc.strategy.speculates:
            score = inc.recent_tps or predict_plain(self.cost).tokens_per_s
            inc.predicted_tps = inc.predicted_tps or score
            self.state.best_score, self.state.best_match = score, 0.0
            return score
        got = self.score(decoder, inc.strategy, tokens)
        if got is None:
            return None
        score, inc.raw_tps, rate = got
        self.state.best_score, self.state.best_match = score, rate
        return score

    # ----------------------------------------------------------------- windows
    def _new_window(self, decoder: Decoder, tokens: list[int]) -> None:
        """Fresh tokens: correct the incumbent from its measured stretch, re-score it and the
        racers, start a measured trial for the best racer that kept winning, sweep the free
        families, step around the incumbent; stop once it led on ``stop_windows`` windows."""
        state = self.state
        inc = self.incumbent
        self.racing.correct(inc)
        incumbent = self._incumbent_score(decoder, tokens)
        if incumbent is None:
            return
        if inc.strategy.speculates:
            inc.raws.append(inc.raw_tps)
        self.window.mark(tokens)
        state.windows += 1
        was_done = state.done
        survivors = self.racing.rescore(decoder, tokens, incumbent, self.score)
        if not state.done or state.watching:  # a stopped tuner only finishes its race; a watching one sweeps
            survivors += self._sweep(decoder, tokens, incumbent)
        if state.watching and survivors:  # the text moved: a candidate beats the incumbent again
            state.resume()
        if self.racing.measure_best(decoder, survivors, incumbent, self.settings.rush_margin):
            state.measured()
        for near in self.space.neighbours(inc.strategy, self.ctx):  # a local step around the incumbent
            self.trials.enqueue(near)
        state.after_window(bool(survivors), self.settings)
        state.check_limits(self.settings, inc.strategy.speculates)
        if (state.done and not was_done) or state.unmeasured(self.settings.stop_windows):
            self._measure_rival(decoder)

    def _measure_rival(self, decoder: Decoder) -> None:
        """A stop, or ``stop_windows`` windows unmeasured: measure the nearest rival (``Race.measure_rival``)."""
        if self.racing.measure_rival(decoder, self.settings.rival_margin, self._tell_swept):
            self.state.measured(rival=True)

    def _sweep(self, decoder: Decoder, tokens: list[int], incumbent: float) -> list[Racer]:
        """Sweep the free families at every point of their grids (``Race.sweep``); the racers that
        joined are told to the study as trials (sampler ``sweep``). -> those racers."""
        points = self.families.points(self.incumbent.strategy)
        joined, swept = self.racing.sweep(decoder, tokens, incumbent, points, self.score, self._tell_swept)
        self.state.swept += swept
        if joined:
            self.state.since_improvement = 0
        return joined

    def _tell_swept(self, strategy: Strategy, score: float, raw: float, rate: float) -> int:
        """Record a swept point as a finished trial (-> its number)."""
        self.state.trials += 1
        return self.trials.tell_swept(strategy, score, raw, rate)

    # ----------------------------------------------------------------- decisions
    def _decide(self, decoder: Decoder, tokens: list[int]) -> None:
        """End a measured trial (``Race.decide``): the challenger's correction learns from what it
        measured, and a speculating incumbent is scored on the window the challenger just decoded
        (what it would have done on the same tokens)."""
        ch = self.challenger
        assert ch is not None
        self.racing.challenger = None
        self.racing.correct(ch)
        same_text = None
        if self.incumbent.strategy.speculates:
            same_text = self._incumbent_score(decoder, tokens)
            self.window.mark(tokens)  # the window just scored is the latest (trials reuse its matches)
        if self.racing.decide(decoder, ch, same_text):
            self.state.since_improvement = self.state.stable = 0
            if self.state.watching:  # a rival measured at the stop won: the incumbent the stop rested on is gone
                self.state.resume()

    def _trial(self, decoder: Decoder, tokens: list[int]) -> bool:
        """Ask the study for a candidate, score it on ``tokens`` and tell the study; it joins the
        race when it beats the incumbent. -> whether tuning goes on."""
        state = self.state
        incumbent = self._incumbent_score(decoder, tokens)
        if incumbent is None:
            return False
        trial, sampler = self.trials.ask()
        try:
            strategy = self.space.define(trial, self.ctx)
            got = self.score(decoder, strategy, tokens)
        except BaseException:  # Ctrl-C included: the trial is closed as failed, not left running
            self.trials.fail(trial)
            raise
        if got is None:  # its drafter cannot score this window (yet, or not within the allowance)
            self.trials.prune(trial)
            state.unscored += 1
            return True  # the next trial may be one that scores for free
        score, raw, rate = got
        self.trials.tell(trial, sampler, strategy, score, raw, rate)
        state.trials += 1
        state.since_improvement += 1
        self.racing.note(strategy, got, incumbent, trial.number)
        if self.racing.join(strategy, trial.number, score, raw, rate, incumbent):
            state.since_improvement = 0
        state.check_limits(self.settings, self.incumbent.strategy.speculates)
        if state.done:
            self._measure_rival(decoder)
        return not state.done

    # ----------------------------------------------------------------- results
    @property
    def best(self) -> Strategy:
        return self.incumbent.strategy

    def predicted_tps(self, strategy: Strategy) -> float | None:
        """A kept strategy's corrected prediction for the task (``Race.predicted_tps``)."""
        return self.racing.predicted_tps(strategy)

    def task_tps(self, strategy: Strategy) -> float | None:
        """``strategy``'s corrected prediction over everything decoded while tuning, where that
        costs no forward: prompt lookup replayed over every output in full (``lookup_rounds``:
        the match statistics of the text itself); any other kind's task prediction when it was
        kept (``predicted_tps``); else None."""
        if strategy.drafter == "prompt-lookup":
            raw = replay_lookup(strategy, self.decoded, self.ctx.max_draft_length, self.cost)
            return raw * self.correction(strategy) if raw else None
        return self.predicted_tps(strategy)

    def flush(self) -> None:
        """Copy the trials finished since the last flush into the persistent study."""
        self.trials.flush()

    def summary(self) -> dict[str, Any]:
        plain_s = self.cost.plain_step_s()
        return {
            "plain_predicted_tps": 1.0 / plain_s if plain_s > 0 else None,
            "best_predicted_tps": self.predicted_tps(self.incumbent.strategy) or 0.0,
            "best_matchness": self.incumbent.matchness,
            **self.state.report(),
            **self.racing.summary(),  # rejected, switches, reverted, kept
        }
