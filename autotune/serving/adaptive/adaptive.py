"""Adaptive serving: drift detection per route, plain fallback, re-tuning on live traffic, and
new routes from unknown traffic.

Every auto-routed request feeds its route's **health** (``health``): exponentially weighted
acceptance and decode tokens/s (``ewma`` = the newest request's weight), greedy and sampled
requests apart. After ``min_requests`` requests of a band a route whose stored strategy
speculates is judged (``judge``):

- **slower than plain**: its tokens/s is below plain decoding's speed on this route's own requests
  (``slower_margin`` below it; the cost model's timed step until the route has decoded plainly).
  It falls back to plain decoding at once, and
- **acceptance drift**: the greedy band's acceptance fell below ``(1 - acceptance_drop)`` x the
  acceptance its strategy was stored with (measured greedily), and by at least
  ``acceptance_floor_drop``; the sampled band is compared with its own first figure.

Either way the route **re-tunes** (``retune.Retune``): its next ``retune_requests`` requests decode
with the online tuner (``autotune.tuning.tuner``, the ``auto`` space, tuning at most
``retune_share`` of their decode time; the stored strategy is the first candidate). A draft
model is scored only once that share covers its catch-up over the request's text
(``TunerSettings.defer_catch_up``): on GSM8K's 760-token prompts the catch-up alone took 2.6 s
of a 14 s request. The tuner's incumbent is plain decoding until a candidate measured faster on
this route's tokens, so the fallback is immediate and greedy output stays plain decoding's throughout. At the end the tuner's
pick is checked against plain decoding's measured speed on the same requests, and the faster one
is the result. It is checked on the first ``check_requests`` requests it tuned on (greedily,
``check_tokens`` each, decoded after the last request's answer, on the decode thread): stored only
when its output equals plain decoding's (the rule ``study`` applies), and replacing the best row
it re-tuned (``Storage.record(..., supersedes=)``) only when it decoded them at least as fast as
the route's stored strategy did; otherwise only its history row is written and the route keeps
its strategy, judged from then on against the acceptance it measured on the new traffic.

A route stored as **plain** decoding has no acceptance to drift; traffic that turned
speculation-friendly would never be noticed. After ``recheck_plain_requests`` requests on its
plain entry it re-tunes the same way (plain stays the incumbent, so nothing is lost but the capped
tuning share), and the result, plain again or a faster strategy, becomes its entry.

Requests routed to ``unknown`` (far from every task) decode as without ``--adaptive``: with the
store's general entry (task ``prompts``), else the server's fallback (``Control.unknown_start``),
starting plainly where their pending cluster's live acceptance (``jobs.live_keys``) says drafting
is at a loss (``Control.live_start``); each request's controller may still switch on its own
tokens. A plain ``unknown`` is re-checked like any plain route (``recheck_plain_requests``), and
its result is stored as the general entry (later unknown requests decode with it).

They also collect into **pending clusters** (``PendingClusters``, at most ``max_clusters``; an
evicted cluster's re-tune is dropped with it): each joins the nearest cluster by task form and
content (``clusters``: character n-grams of its instruction part beside the router's word TF-IDF)
under the router's threshold, or opens a new one, so mixed unknown traffic becomes several
routes, not one. After ``new_route_requests`` requests a cluster re-tunes like a route and
is stored as a new task named from its top TF-IDF words (``auto:word-word``; without
``store_prompts`` a hash of them, ``auto:topic-3f9a01c2``), and the router refits: later requests of
that kind route there directly. At most ``max_routes`` such routes exist per model, draft and
hardware. A new route's name is claimed in the store at the write (``Storage.record(new_key=)``),
so two replicas naming the same topic store two routes, never one over the other.

What is stored with a result: the route's prompts, then the requests' routing texts as their
hashed terms (``routing.terms``: routable, not readable back as text), or as text with
``store_prompts``.

Only auto-routed requests adapt: ``plain``, ``default`` and explicit ids are served as asked and
measured for no route. Everything here runs on the decode worker's thread but the store writes: a
re-tune's result goes to a background writer (``writer.StoreWriter``, bounded retries), so a slow
or locked store never stalls decoding nor fails a request that decoded; the request that completed
the re-tune answers once the result is checked and stored (at most ``jobs.HOLD_S``). A re-tune
that raises is dropped: its route goes on with its stored strategy. ``/health`` reads
``describe()``, a snapshot the worker publishes after each request, never the live state.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import optuna

from autotune.serving.adaptive.clusters import NEW_ROUTE_PREFIX, PendingClusters, new_route_name, unique_name
from autotune.serving.adaptive.health import RouteHealth, judge
from autotune.serving.adaptive.results import Destination, check, result_write
from autotune.serving.adaptive.retune import Retune
from autotune.serving.adaptive.settings import AdaptSettings
from autotune.serving.adaptive.source import DecoderSource
from autotune.serving.adaptive.writer import StoreWriter
from autotune.serving.jobs import EXPLICIT_ROUTES, cluster_key
from autotune.serving.routing.book import GENERAL_TASK
from autotune.serving.routing.router import UNKNOWN
from autotune.serving.routing.terms import as_terms
from autotune.tuning.controller import controller_cost
from autotune.tuning.cost_model import MeasuredCostModel
from autotune.tuning.tuner import OnlineTuner, TunerSettings
from runtime.decoding import Decoder, GenerationResult
from runtime.pipeline import default_draft
from runtime.stats import DecodeStats
from search_spaces.errors import SpaceError
from search_spaces.layer_plan import SKIP_RATIO
from search_spaces.strategy import PLAIN, Strategy

ADAPTIVE_ROUTES_EXCLUDED = EXPLICIT_ROUTES  # explicit choices are served as asked
EVENTS_KEPT = 256
log = logging.getLogger("autotune.serve")

__all__ = ["Adapter", "PendingClusters", "Retune", "RouteHealth", "judge", "new_route_name", "unique_name"]


def _after_decode(work: Callable[[], None]) -> None:
    """Bookkeeping after a request decoded: a failure here must not fail that request."""
    try:
        work()
    except Exception:
        log.exception("adaptive serving's bookkeeping failed after a successful decode; the route "
                      "keeps its stored strategy")


def _in_space(space: Any, ctx: Any, strategy: Strategy) -> bool:
    try:
        space.encode(strategy, ctx)
    except SpaceError:
        return False
    return True


class Adapter:
    """Per-route health, re-tunes and new routes of one server (decode worker thread only)."""

    def __init__(self, settings: AdaptSettings, pool: Any, target: Any, draft: str | None, device: str,
                 storage: Any, book: Any, metrics: Any, decoders: DecoderSource) -> None:
        from autotune.tuning.study import space_context, standby_strategies, verify_width
        from search_spaces.spaces import get_space

        self.settings, self.pool, self.target, self.draft = settings, pool, target, draft
        self.book, self.metrics, self.decoders = book, metrics, decoders
        self.destination = Destination(storage, book, target, draft, device)  # where results are stored
        self.space = get_space(settings.space)
        draft_model = default_draft(pool, draft) if draft else None
        self.ctx = space_context(self.space, target, draft_model, SKIP_RATIO)
        self.width = verify_width(self.space, self.ctx)
        self.standby = standby_strategies(self.space, self.ctx)
        self.health: dict[str, RouteHealth] = {}
        self.retunes: dict[str, Retune] = {}
        self.pending = PendingClusters(book.router.threshold, settings.max_clusters)  # unknown requests, by topic
        # a re-tune that kept the stored strategy: the acceptance it measured on the new traffic
        # becomes the route's reference (route -> (history row, acceptance)), so it is not re-tuned again
        self.references: dict[str, tuple[int | None, float | None]] = {}
        self.cost: MeasuredCostModel | None = None
        self.events: deque[dict[str, Any]] = deque(maxlen=EVENTS_KEPT)  # re-tunes and stored results, in order
        self.writer = StoreWriter(metrics)  # the store writes, off this thread
        # work after a request was answered, and the event its answer waits for
        self.deferred: deque[tuple[Callable[[], None], tuple[threading.Event, ...]]] = deque()
        self._capped = False  # logged that the route cap was reached
        self._published: dict[str, Any] = {}
        self._publish()

    # ------------------------------------------------------------------ the decode worker's calls
    def begin(self, job: Any) -> Retune | None:
        """Route ``job`` as its route's state says (``job.choice`` may change) -> the re-tune whose
        tuner decodes it (``generate_retune``, alone), or None: it decodes with ``job.choice``'s
        strategy (in the batch), and ``decoded`` is called with its result."""
        job.adapt = None
        choice = job.choice
        if choice.route in ADAPTIVE_ROUTES_EXCLUDED:  # served as asked, measured for no route
            return None
        health = self._health(choice)
        cluster = self.pending.assign(job.text) if choice.route == UNKNOWN else None
        retune = (self.retunes.get(cluster_key(cluster)) if cluster is not None else None) \
            or self.retunes.get(choice.route)
        if retune is not None:
            job.choice = replace(choice, label="tuning", state="tuning")
            if retune.cluster is not None:
                self.pending.touch(retune.cluster)  # a cluster re-tuning is not the stalest
        job.adapt = (retune, health, cluster, choice)
        return retune

    def generate_retune(self, job: Any, retune: Retune, after_round: Callable) -> GenerationResult:
        """Decode ``job`` with its route's re-tune (the tuner drives its rounds)."""
        state = retune.tuner.state
        before = (state.tuning_s, state.trials, state.swept)
        try:
            result = retune.generate(job.ids, job.cfg, self._storable(job.text), after_round)
            job.tuning = {"tuning_s": state.tuning_s - before[0], "trials": state.trials - before[1],
                          "swept": state.swept - before[2], "request": retune.requests}
        except Exception:  # this request fails; its route goes on with its stored strategy
            self._drop(retune, "failed")
            self._publish()
            raise
        _after_decode(lambda: self._after_retune_request(retune, job))
        self._publish()
        return result

    def decoded(self, job: Any, result: GenerationResult) -> None:
        """``job`` (routed by ``begin``, no re-tune) decoded: judge its route on it."""
        if job.adapt is not None:
            _, health, cluster, choice = job.adapt
            sampled = not job.cfg.sampling.greedy
            _after_decode(lambda: self._judge(health, choice, cluster, job.text, result.stats, sampled))
        self._publish()

    def after_answer(self, skip: bool = False) -> None:
        """Work a request left for after its answer (a re-tune's lossless check and store write);
        ``skip`` (the server is draining): none, its answer goes out at once."""
        while self.deferred:
            work, waiting = self.deferred.popleft()
            try:
                if not skip:
                    work()
            except Exception:
                log.exception("adaptive serving's work after a request failed; the route keeps its stored strategy")
            finally:
                if skip:  # else the work sets them (a write sets its own once it landed)
                    for event in waiting:
                        event.set()
        self._publish()

    def describe(self) -> dict[str, Any]:
        """Per-route figures for ``/health``: the snapshot published after the last request (safe
        from any thread: the decode thread replaces it whole, never changes it)."""
        return self._published

    def close(self) -> None:
        self.writer.close()

    # ------------------------------------------------------------------ internals
    def _judge(self, health: RouteHealth, choice: Any, cluster: int | None, text: str, stats: DecodeStats,
               sampled: bool) -> None:
        if not choice.strategy.speculates:
            health.observe_plain(stats, self.settings.ewma)
        if cluster is not None:  # far from every route: collect them by topic into new ones
            size = self.pending.add(cluster, text)
            self._drop_evicted()
            if size >= self.settings.new_route_requests and self._room_for_a_route():
                self._start(health, f"{size} requests far from every route", cluster)
                return
        health.observe(stats, self.settings.ewma, sampled)
        reason = judge(health, self._plain_tps(health), self.settings)
        if reason is not None and choice.route not in self.retunes:
            health.fallbacks += reason.startswith("slower")
            self._start(health, reason)

    def _drop_evicted(self) -> None:
        """Re-tunes of the pending clusters just dropped to make room go with them."""
        for cid in self.pending.take_evicted():
            retune = self.retunes.get(cluster_key(cid))
            if retune is not None:
                self._drop(retune, "evicted")

    def _room_for_a_route(self) -> bool:
        """Whether unknown traffic may become one more route (``max_routes`` counts the stored ones
        of this model, draft and hardware, and the re-tunes creating one)."""
        made = {e.task for e in self.book.entries if e.task.startswith(NEW_ROUTE_PREFIX)}
        making = sum(r.cluster is not None for r in self.retunes.values())
        if len(made) + making < self.settings.max_routes:
            return True
        if not self._capped:
            log.warning("unknown traffic is not turned into more routes: %d of --max-routes %d exist or are "
                        "being made; it decodes with the general entry", len(made) + making, self.settings.max_routes)
            self._capped = True
        return False

    def _storable(self, text: str) -> str:
        """A request's routing text as the store keeps it: the text only with ``store_prompts``."""
        return text if self.settings.store_prompts else as_terms(text)

    def _publish(self) -> None:
        self._published = {
            route: {"strategy": h.label, "state": "tuning" if route in self.retunes else "stored",
                    "acceptance": h.acceptance, "stored_acceptance": h.stored_acceptance,
                    "sampled_acceptance": h.sampled.acceptance, "tokens_per_s": h.tps,
                    "plain_tokens_per_s": h.plain_tps, "requests": h.requests, "retunes": h.retunes,
                    "fallbacks": h.fallbacks, "reason": h.reason}
            for route, h in self.health.items()
        } | {"pending_unknown": sum(self.pending.sizes().values()),
             "pending_clusters": list(self.pending.sizes().values()), "live_retunes": len(self.retunes)}

    def _health(self, choice: Any) -> RouteHealth:
        """The route's health; a new one when the route's stored entry changed (re-tuned here, by
        another replica, or by a study)."""
        entry = choice.entry
        h = self.health.get(choice.route)
        history_id = entry.history_id if entry is not None else None
        if h is None or h.label != choice.label or h.strategy != choice.strategy or h.history_id != history_id:
            old = h
            reference = entry.acceptance if entry is not None else None
            kept = self.references.get(choice.route)
            if kept is not None and kept[0] == history_id and kept[1] is not None:
                reference = kept[1]
            h = self.health[choice.route] = RouteHealth(choice.route, choice.strategy, choice.label,
                                                        stored_acceptance=reference, history_id=history_id)
            if old is not None:
                h.retunes, h.fallbacks, h.plain_tps = old.retunes, old.fallbacks, old.plain_tps
        return h

    def _plain_tps(self, health: RouteHealth) -> float | None:
        """Plain decoding's speed on this route; the cost model's timed step until it has one."""
        if health.plain_tps is None:
            step = self._cost().plain_step_s()
            return 1.0 / step if step > 0 else None
        return health.plain_tps

    def prepare(self) -> None:
        """Time the re-tunes' cost model now (while ``/health`` says loading). Timed lazily, its
        timings fell in the first re-tune's first request: 3.7 s of tuning in a 96-token ASDiv
        request on the 1.5B at int4 (9.1 tok/s against plain decoding's 14.1)."""
        import torch

        with torch.inference_mode():
            self._cost().prepare()

    def _cost(self) -> MeasuredCostModel:
        """The re-tunes' cost model: the worker's controllers' one for the same models (timed at
        start-up and refreshed by every controlled request), else one of its own."""
        if self.cost is None:
            decoder = self._decoder()
            shared = self.decoders.shared_cost(decoder)
            self.cost = shared if shared is not None else \
                controller_cost(decoder, repeats=1, warm=False, verify_width=self.decoders.verify_width)
        return self.cost

    def _decoder(self) -> Decoder:
        """A tuning decoder: every drafter kind of the space, at the worker's one verify width."""
        from runtime.pipeline import build_decoder

        uses_draft = self.draft if "draft-model" in self.space.kinds(self.ctx) else None
        width = max(self.decoders.verify_width, self.width)  # == the worker's: start-up made it so
        self.decoders.note_width(width)
        return build_decoder(self.pool, self.target, PLAIN, uses_draft, verify_width=width, standby=self.standby)

    def _start(self, health: RouteHealth, reason: str, cluster: int | None = None) -> None:
        """Re-tune ``health``'s route (or the pending ``cluster`` of unknown traffic) on its next
        requests (plain decoding first; the stored strategy is the first candidate tried)."""
        s = self.settings
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.create_study(direction="maximize")
        stored = health.strategy if cluster is None else PLAIN
        initial = stored if stored.speculates and _in_space(self.space, self.ctx, stored) else PLAIN
        # on live traffic a draft's catch-up over a request's prompt waits until the share covers it
        tuner = OnlineTuner(self.space, self.ctx, study, self._cost(),
                            TunerSettings(max_share=s.retune_share), initial)
        if cluster is not None:
            known = [p for e in self.book.entries for p in e.prompts]
            texts = self.pending.texts(cluster)
            taken = {e.task for e in self.book.entries} | {r.task for r in self.retunes.values()}
            name = new_route_name(texts, known, readable=s.store_prompts)
            task, prompts, supersedes = unique_name(name, taken), [self._storable(t) for t in texts], None
        else:  # a route, or ``unknown`` as a whole: its result is the general entry
            task = GENERAL_TASK if health.route == UNKNOWN else health.route
            entry = next((e for e in self.book.entries if e.task == task), None)
            prompts, supersedes = list(entry.prompts) if entry else [], health.history_id
        retune = Retune(health.route, task, self._decoder(), tuner, prompts, supersedes, reason, cluster,
                        stored=stored, stored_acceptance=health.acceptance, keep_ids=s.check_requests)
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
        if why == "failed":
            log.error("the re-tune of route %s failed; the route keeps its stored strategy", retune.route,
                      exc_info=True)
        if why != "done":
            self.events.append({"event": f"retune_{why}", "route": retune.route, "task": retune.task})

    def _after_retune_request(self, retune: Retune, job: Any) -> None:
        """After the last request of ``retune``: decide what it stores; the check and the write come
        after this request's answer is ready (``after_answer``), which waits for them
        (``jobs.CHECK_HOLD_S`` and ``jobs.HOLD_S`` at most)."""
        if retune.requests < self.settings.retune_requests:
            return
        self._drop(retune, "done")
        strategy, tps, acceptance, predicted = retune.outcome()
        health = self.health.get(retune.route)
        if health is not None and retune.plain_tps():
            health.plain_tps = retune.plain_tps()  # plain decoding measured on this route's requests
        hold, checked = threading.Event(), threading.Event()
        job.hold, job.checked = hold, checked

        def check_and_store() -> None:
            try:
                self._store(retune, strategy, tps, acceptance, predicted, hold)
            finally:
                checked.set()

        self.deferred.append((check_and_store, (hold, checked)))

    def _store(self, retune: Retune, strategy: Strategy, tps: float, acceptance: float | None,
               predicted: float | None, hold: threading.Event) -> None:
        """Check ``retune``'s result on the first requests it tuned on (``results.check``) and hand
        it to the store writer (``hold`` is set once stored, or at once when nothing is written)."""
        verdict = check(self.decoders, retune, strategy, self.settings.check_tokens)
        if not verdict.lossless:
            log.warning("the re-tune of route %s picked %s, whose greedy output differed from plain decoding's "
                        "on the requests it tuned on; it is not stored", retune.route, strategy.to_json())
            self.events.append({"event": "retune_lossy", "route": retune.route, "task": retune.task,
                                "strategy": strategy.to_dict()})
            hold.set()
            return
        if not verdict.replaces:  # the stored strategy stays, judged from now on against what it measured here
            self.references[retune.route] = (retune.supersedes, retune.stored_acceptance)
        self.writer.submit(result_write(self.destination, retune, strategy, tps, acceptance, predicted,
                                        verdict.replaces, hold, self.events.append))
