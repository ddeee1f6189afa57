"""Adaptive serving: drift detection per route, plain fallback, re-tuning on live traffic, and
new routes from unknown traffic.

Every auto-routed request feeds its route's **health**: exponentially weighted acceptance and
decode tokens/s (``ewma`` = the newest request's weight). After ``min_requests`` requests a route
whose stored strategy speculates is judged (``judge``):

- **slower than plain**: its tokens/s is below plain decoding's measured speed on this machine
  (``slower_margin`` below it; plain's speed is an EWMA over the requests decoded plainly, the
  cost model's timed step until there is one). It falls back to plain decoding at once, and
- **acceptance drift**: its acceptance fell below ``(1 - acceptance_drop)`` x the acceptance its
  strategy was stored with, and by at least ``acceptance_floor_drop`` (for a row stored without
  one: the route's first judged figure).

Either way the route **re-tunes**: its next ``retune_requests`` requests decode with the online
tuner (``autotune.tuning.tuner``, the ``auto`` space, tuning at most ``retune_share`` of their decode
time). The tuner's incumbent is plain decoding until a candidate measured faster on this route's
tokens, so the fallback is immediate and greedy output stays plain decoding's throughout. At
the end the tuner's pick is checked against plain decoding's measured speed on the same requests,
and the faster one is stored as the route's entry: a new history row (with the route's prompts and
the requests' texts), replacing the best row it re-tuned (``Storage.record(..., supersedes=)``:
a second replica that re-tuned the same route keeps the better of the two). The book is refitted.

A route stored as **plain** decoding has no acceptance to drift; traffic that turned
speculation-friendly would never be noticed. After ``recheck_plain_requests`` requests on its
plain entry it re-tunes the same way (plain stays the incumbent, so nothing is lost but the capped
tuning share), and the result, plain again or a faster strategy, becomes its entry.

Requests routed to ``unknown`` (far from every task) decode with the store's general entry (task
``prompts``) or, with none stored, the **server's default strategy** (a confidence-stopped draft
chain when a draft is served) rather than plain decoding: the judge watches ``unknown`` like any
route, so where the default is slower than plain it falls back and re-tunes, and the result is
stored as the general entry (later unknown requests decode with it). On the Qwen pair's replay the
default ran 1.20x plain on MT-Bench questions, which route to ``unknown``.

They also collect into **pending clusters**
(``PendingClusters``): each joins the nearest cluster by the router's own TF-IDF centroid distance
and threshold, or opens a new one, so mixed unknown traffic becomes several routes, not one. After
``new_route_requests`` requests a cluster re-tunes like a route (its next requests decode with the
tuner) and is stored as a new task named from its top TF-IDF terms (``auto:word-word``), with its
prompts, and the router refits: later requests of that kind route there directly.

Only auto-routed requests adapt: ``plain``, ``default`` and explicit ids are served as asked (they
feed plain decoding's measured speed). Everything here runs on the decode worker's thread but
the store writes: a re-tune's result goes to a background writer (``writer.StoreWriter``, bounded
retries), so a slow or locked store never stalls decoding nor fails a request that decoded; the
request that completed the re-tune answers once the result is stored (at most ``worker.HOLD_S``).
A re-tune that raises is dropped: its route goes on with its stored strategy. ``/health`` reads
``describe()``, a snapshot the worker publishes after each request, never the live state.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import optuna

from autotune.serving.adaptive.clusters import PendingClusters, new_route_name, unique_name
from autotune.serving.adaptive.settings import AdaptSettings
from autotune.serving.adaptive.writer import StoreWriter, Write
from autotune.serving.routing.book import GENERAL_TASK
from autotune.serving.routing.router import UNKNOWN
from autotune.store.records import ResultMetrics
from autotune.store.resolve import strategy_key
from autotune.tuning.cost_model import MeasuredCostModel
from autotune.tuning.tuner import OnlineTuner, TunerSettings
from runtime.decoding import Decoder, GenerationResult
from runtime.stats import DecodeStats
from search_spaces.strategy import PLAIN, Strategy

ADAPTIVE_ROUTES_EXCLUDED = ("plain", "default", "id")  # explicit choices are served as asked
EVENTS_KEPT = 256
log = logging.getLogger("autotune.serve")


def _ewma(old: float | None, new: float, weight: float) -> float:
    return new if old is None else (1.0 - weight) * old + weight * new


@dataclass
class RouteHealth:
    """What a route measured since its strategy was stored (or re-tuned)."""

    route: str
    strategy: Strategy
    label: str  # the stored row's id, or "plain"
    stored_acceptance: float | None  # what the strategy was stored with (None: not known)
    history_id: int | None = None  # the stored best's history row (what a re-tune supersedes)
    acceptance: float | None = None
    tps: float | None = None
    requests: int = 0
    retunes: int = 0
    fallbacks: int = 0
    reason: str = ""  # why it last re-tuned

    def observe(self, stats: DecodeStats, weight: float) -> None:
        self.requests += 1
        if stats.drafted:
            self.acceptance = _ewma(self.acceptance, stats.acceptance_rate, weight)
        if stats.decode_tokens_per_s:
            self.tps = _ewma(self.tps, stats.decode_tokens_per_s, weight)


def judge(health: RouteHealth, plain_tps: float | None, settings: AdaptSettings) -> str | None:
    """Why ``health``'s route must re-tune now, or None: the server's drift rule. Its one side
    effect: a row stored without an acceptance takes the first judged figure as its reference."""
    if not health.strategy.speculates:  # nothing to drift: re-check now and then whether speculation pays
        if health.requests >= settings.recheck_plain_requests:
            return f"plain for {health.requests} requests: re-checking whether speculation pays"
        return None
    if health.requests < settings.min_requests:
        return None
    if plain_tps and health.tps is not None and health.tps < (1.0 - settings.slower_margin) * plain_tps:
        return f"slower than plain ({health.tps:.2f} < {plain_tps:.2f} tok/s)"
    if health.acceptance is None:
        return None
    if health.stored_acceptance is None:  # stored without one: the first judged figure is the reference
        health.stored_acceptance = health.acceptance
        return None
    bar = min((1.0 - settings.acceptance_drop) * health.stored_acceptance,
              health.stored_acceptance - settings.acceptance_floor_drop)
    if health.acceptance < bar:
        return f"acceptance {health.acceptance:.2f} < {bar:.2f} (stored {health.stored_acceptance:.2f})"
    return None


@dataclass
class Retune:
    """The online tuner on one route's live requests."""

    route: str  # the route re-tuned (``unknown``: a new route)
    task: str  # the store key's task it will be recorded under
    decoder: Decoder
    tuner: OnlineTuner
    prompts: list[str]  # routing texts stored with the result (the entry's, then the requests')
    supersedes: int | None
    reason: str
    cluster: int | None = None  # the pending cluster of unknown traffic it turns into a route
    requests: int = 0
    wall_s: float = 0.0
    stats: DecodeStats = field(default_factory=DecodeStats)

    @property
    def key(self) -> str:
        """Its key among the running re-tunes: the route, or ``unknown#<cluster>``."""
        return self.route if self.cluster is None else f"{self.route}#{self.cluster}"

    def generate(self, ids: list[int], cfg: Any, text: str, after_round: Callable | None) -> GenerationResult:
        self.tuner.start_prompt(len(ids))
        t0 = time.perf_counter()
        result = self.decoder.generate(ids, cfg, before_round=self.tuner.before_round, after_round=after_round)
        self.tuner.end_prompt(ids + result.tokens, result.stats)
        self.wall_s += time.perf_counter() - t0
        self.requests += 1
        self.stats = self.stats.merge(result.stats)
        self.prompts.append(text)
        return result

    def outcome(self) -> tuple[Strategy, float, float | None, float | None]:
        """-> (strategy to store, its measured tokens/s, acceptance, predicted tokens/s): the
        tuner's pick when it measured faster than plain decoding on these requests, else plain."""
        tuner = self.tuner
        plain = tuner.kept[0]  # plain decoding: the incumbent every re-tune starts from
        plain_tps = plain.recent_tps or plain.measured_tps or 0.0
        best = next((k for k in reversed(tuner.kept) if k.strategy == tuner.best), plain)
        if best.strategy.speculates and (best.measured_tps or 0.0) > plain_tps:
            return best.strategy, best.measured_tps or 0.0, best.acceptance, tuner.predicted_tps(best.strategy)
        return PLAIN, plain_tps, None, plain_tps or None


class Adapter:
    """Per-route health, re-tunes and new routes of one server (decode worker thread only)."""

    def __init__(self, settings: AdaptSettings, pool: Any, target: Any, draft: str | None, device: str,
                 storage: Any, book: Any, metrics: Any, worker: Any) -> None:
        from autotune.tuning.study import space_context, standby_strategies, verify_width
        from search_spaces.spaces import get_space

        self.settings, self.pool, self.target, self.draft, self.device = settings, pool, target, draft, device
        self.storage, self.book, self.metrics, self.worker = storage, book, metrics, worker
        self.space = get_space(settings.space)
        draft_model = pool.get(draft, "float32") if draft else None
        self.ctx = space_context(self.space, target, draft_model, 0.45)
        self.width = verify_width(self.space, self.ctx)
        self.standby = standby_strategies(self.space, self.ctx)
        self.health: dict[str, RouteHealth] = {}
        self.retunes: dict[str, Retune] = {}
        self.pending = PendingClusters(book.router.threshold)  # unknown requests' routing texts, by topic
        self.plain_tps: float | None = None
        self.cost: MeasuredCostModel | None = None
        self.events: deque[dict[str, Any]] = deque(maxlen=EVENTS_KEPT)  # re-tunes and stored results, in order
        self.writer = StoreWriter(metrics)  # the store writes, off this thread
        self._published: dict[str, Any] = {}
        self._publish()

    # ------------------------------------------------------------------ the decode worker's calls
    def generate(self, job: Any, after_round: Callable) -> GenerationResult:
        """Decode ``job`` as its route's state says: a re-tune's tuner, or the routed strategy."""
        try:
            return self._generate(job, after_round)
        finally:
            self._publish()

    def describe(self) -> dict[str, Any]:
        """Per-route figures for ``/health``: the snapshot published after the last request (safe
        from any thread: the decode thread replaces it whole, never changes it)."""
        return self._published

    def close(self) -> None:
        self.writer.close()

    # ------------------------------------------------------------------ internals
    def _generate(self, job: Any, after_round: Callable) -> GenerationResult:
        choice = job.choice
        if choice.route in ADAPTIVE_ROUTES_EXCLUDED:
            return self._plainly_measured(job, self.worker.decoder(choice.strategy).generate(
                job.ids, job.cfg, after_round=after_round))
        if choice.route == UNKNOWN and choice.entry is None:  # no general entry yet: the server's default
            default = self.book.default
            choice = job.choice = replace(choice, strategy=default, label="default" if default.speculates else "plain")
        health = self._health(choice)
        cluster = self.pending.assign(job.text) if choice.route == UNKNOWN else None
        retune = (self.retunes.get(f"{UNKNOWN}#{cluster}") if cluster is not None else None) \
            or self.retunes.get(choice.route)
        if retune is not None:
            job.choice = replace(choice, label="tuning", state="tuning")
            try:
                result = retune.generate(job.ids, job.cfg, job.text, after_round)
            except Exception:  # this request fails; its route goes on with its stored strategy
                self._drop(retune, "failed")
                raise
            self._after_decode(lambda: self._after_retune_request(retune, job))
            return result
        result = self.worker.decoder(choice.strategy).generate(job.ids, job.cfg, after_round=after_round)
        self._plainly_measured(job, result)
        self._after_decode(lambda: self._judge(health, choice, cluster, job.text, result.stats))
        return result

    def _judge(self, health: RouteHealth, choice: Any, cluster: int | None, text: str, stats: DecodeStats) -> None:
        if cluster is not None:  # far from every route: collect them by topic into new ones
            size = self.pending.add(cluster, text)
            if size >= self.settings.new_route_requests:
                self._start(health, f"{size} requests far from every route", cluster)
                return
        health.observe(stats, self.settings.ewma)
        reason = judge(health, self._plain_tps(), self.settings)
        if reason is not None and choice.route not in self.retunes:
            health.fallbacks += reason.startswith("slower")
            self._start(health, reason)

    @staticmethod
    def _after_decode(work: Callable[[], None]) -> None:
        """Bookkeeping after a request decoded: a failure here must not fail that request."""
        try:
            work()
        except Exception:
            log.exception("adaptive serving's bookkeeping failed after a successful decode; the route "
                          "keeps its stored strategy")

    def _publish(self) -> None:
        self._published = {
            route: {"strategy": h.label, "state": "tuning" if route in self.retunes else "stored",
                    "acceptance": h.acceptance, "stored_acceptance": h.stored_acceptance, "tokens_per_s": h.tps,
                    "requests": h.requests, "retunes": h.retunes, "fallbacks": h.fallbacks, "reason": h.reason}
            for route, h in self.health.items()
        } | {"plain_tokens_per_s": self.plain_tps, "pending_unknown": sum(self.pending.sizes().values()),
             "pending_clusters": list(self.pending.sizes().values())}

    def _health(self, choice: Any) -> RouteHealth:
        """The route's health; a new one when the route's stored entry changed (re-tuned here, by
        another replica, or by a study)."""
        entry = choice.entry
        h = self.health.get(choice.route)
        history_id = entry.history_id if entry is not None else None
        if h is None or h.label != choice.label or h.strategy != choice.strategy or h.history_id != history_id:
            old = h
            h = self.health[choice.route] = RouteHealth(
                choice.route, choice.strategy, choice.label,
                stored_acceptance=entry.acceptance if entry is not None else None, history_id=history_id,
            )
            if old is not None:
                h.retunes, h.fallbacks = old.retunes, old.fallbacks
        return h

    def _plainly_measured(self, job: Any, result: GenerationResult) -> GenerationResult:
        if not job.choice.strategy.speculates and result.stats.decode_tokens_per_s:
            self.plain_tps = _ewma(self.plain_tps, result.stats.decode_tokens_per_s, self.settings.ewma)
        return result

    def _plain_tps(self) -> float | None:
        if self.plain_tps is None:  # nothing decoded plainly yet: the cost model's timed step
            step = self._cost().plain_step_s()
            return 1.0 / step if step > 0 else None
        return self.plain_tps

    def _cost(self) -> MeasuredCostModel:
        if self.cost is None:
            dec = self._decoder()
            drafting = dec.drafter_of("draft-model") or dec.drafter_of("layer-skip")
            self.cost = MeasuredCostModel(draft=drafting.model if drafting is not None else dec.target,
                                          target=dec.target, verify_width=self.width, context=512,
                                          repeats=1, warm=False)
        return self.cost

    def _decoder(self) -> Decoder:
        from runtime.pipeline import build_decoder

        uses_draft = self.draft if "draft-model" in self.space.kinds(self.ctx) else None
        return build_decoder(self.pool, self.target, PLAIN, uses_draft, verify_width=self.width, standby=self.standby)

    def _start(self, health: RouteHealth, reason: str, cluster: int | None = None) -> None:
        """Re-tune ``health``'s route (or the pending ``cluster`` of unknown traffic) on its next
        requests (plain decoding first)."""
        s = self.settings
        settings = TunerSettings(max_share=s.retune_share)
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.create_study(direction="maximize")
        tuner = OnlineTuner(self.space, self.ctx, study, self._cost(), settings)
        if cluster is not None:
            known = [p for e in self.book.entries for p in e.prompts]
            texts = self.pending.texts(cluster)
            taken = {e.task for e in self.book.entries} | {r.task for r in self.retunes.values()}
            task, prompts, supersedes = unique_name(new_route_name(texts, known), taken), texts, None
        else:  # a route, or ``unknown`` as a whole: its result is the general entry
            task = GENERAL_TASK if health.route == UNKNOWN else health.route
            entry = next((e for e in self.book.entries if e.task == task), None)
            prompts, supersedes = list(entry.prompts) if entry else [], health.history_id
        retune = Retune(health.route, task, self._decoder(), tuner, prompts, supersedes, reason, cluster)
        self.retunes[retune.key] = retune
        health.retunes += 1
        health.reason = reason
        self.metrics.retunes.labels(health.route).inc()
        self.events.append({"event": "retune", "route": health.route, "task": task, "reason": reason,
                            "requests": health.requests})

    def _drop(self, retune: Retune, why: str) -> None:
        """End ``retune`` now (its decoder, caches and study go with it); its route is judged
        afresh with its stored entry."""
        self.retunes.pop(retune.key, None)
        if retune.cluster is not None:
            self.pending.drop(retune.cluster)
        health = self.health.get(retune.route)
        if health is not None:  # judged afresh (see _health)
            health.label = ""
        if why != "done":
            log.error("the re-tune of route %s %s; the route keeps its stored strategy", retune.route, why,
                      exc_info=True)
            self.events.append({"event": "retune_failed", "route": retune.route, "task": retune.task})

    def _after_retune_request(self, retune: Retune, job: Any) -> None:
        """After the last request of ``retune``: hand its result to the store writer; ``job``'s
        answer waits for the write (``worker.HOLD_S`` at most), the decode thread does not."""
        if retune.requests < self.settings.retune_requests:
            return
        self._drop(retune, "done")
        strategy, tps, acceptance, predicted = retune.outcome()
        tuning = retune.tuner.state.tuning_s / retune.wall_s if retune.wall_s else 0.0
        key = strategy_key(self.target, self.draft, retune.task, self.device)
        metrics = ResultMetrics.from_throughput(tps, acceptance=acceptance, predicted_tps=predicted,
                                                tuning_share=min(tuning, 1.0), study_name=f"serve:{retune.route}")
        prompts, supersedes, trials = list(retune.prompts), retune.supersedes, retune.tuner.state.trials

        def record() -> int:  # on the writer thread, retried there
            return self.storage.record(key, strategy, metrics, prompts=prompts, supersedes=supersedes)

        def then(history_id: int) -> None:  # on the writer thread, once stored
            self.worker.share_width([strategy])
            self.book.refresh()
            self.events.append({"event": "stored", "route": retune.route, "task": retune.task,
                                "strategy": strategy.to_dict(), "tokens_per_s": tps, "acceptance": acceptance,
                                "history_id": history_id, "tuning_share": tuning, "trials": trials})

        write = Write(f"the re-tune of route {retune.route} (task {retune.task})", record, then)
        job.hold = write.done
        self.writer.submit(write)
