"""Per-request control in the decode worker (``autotune.tuning.controller``): which requests get a
controller, where each starts, the controllers' measured cost models, and what a request far from
every stored task starts on.

An ``unknown`` request (far from every stored task) starts from what similar requests measured, not
from an assumed figure (``live_start``): the live acceptance of its pending cluster's requests
(``serve --adaptive``), else of all ``unknown`` requests, priced by the controllers' cost model; where
its strategy would draft at a loss at that acceptance, it starts plainly (its controller may still
switch). With no live figure yet, the start-up judgement stands (``unknown_start``). Either
judgement starts a request drafting only where its strategy is priced the controllers' switch
margin (``ControlSettings.margin``) above plain decoding, as a controller needs to leave plain: two
timings of one verify differ by more than a price within that margin does."""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import torch

from autotune.serving.decoders import DecoderCache
from autotune.serving.jobs import EXPLICIT_ROUTES, Job, Running, live_keys
from autotune.serving.routing.router import UNKNOWN
from autotune.tuning.controller import ControlSettings, RequestController, RoutePriors, controller_cost, \
    decoder_options, lookup_candidate
from autotune.tuning.corrections import Corrections, KindCorrections
from autotune.tuning.cost_model import MeasuredCostModel
from autotune.tuning.load import DEFAULT_ACCEPTANCE, Candidate, RouteAcceptance, pays_alone
from runtime.decoding import Decoder
from search_spaces.strategy import PLAIN, Strategy

log = logging.getLogger("autotune.serve")
KINDS_KEPT = 256  # kinds of traffic (routes, pending clusters) whose own corrections a server keeps


class Control:
    """The controllers of routed requests (``settings`` None: none, every request keeps its strategy)."""

    def __init__(self, settings: ControlSettings | None, decoders: DecoderCache, acceptance: RouteAcceptance) -> None:
        self.settings, self.decoders = settings, decoders
        self.acceptance = acceptance  # the worker's live acceptance per route and cluster (``jobs.live_keys``)
        self.corrections = Corrections()  # measured / predicted speed per strategy, learned from every request
        self._kinds: OrderedDict[str, Corrections] = OrderedDict()  # ... and per kind of traffic (``kind``)
        self.priors = RoutePriors()  # where each route's requests start: what its latest requests ended on
        self._costs: dict[tuple, MeasuredCostModel] = {}  # cost models, per drafting model and target

    def strategies(self) -> list[Strategy]:
        """What per-request control adds to the strategies served (prompt lookup: every decoder
        keeps it on standby), for the verify width fixed at start-up."""
        if self.settings is None:
            return []
        look = lookup_candidate(self.settings.lookup_length, self.settings.lookup_length + 1)
        return [look] if look is not None else []

    def kind(self, job: Job) -> KindCorrections:
        """The corrections ``job``'s controller prices with: its kind's own (its pending cluster's,
        else its route's; the ``KINDS_KEPT`` kinds seen last), beside the server's."""
        key = live_keys(job)[-1]
        own = self._kinds.get(key)
        if own is None:
            own = self._kinds[key] = Corrections(self.corrections.memory_tokens)
            while len(self._kinds) > KINDS_KEPT:
                self._kinds.popitem(last=False)
        self._kinds.move_to_end(key)
        return KindCorrections(self.corrections, own)

    def cost(self, dec: Decoder) -> MeasuredCostModel:
        """The controllers' measured cost model for ``dec``'s drafting model (one per drafting
        model, timed once - at start-up, ``prepare`` - then refreshed by every request). A new one
        adopts the target's timings from one already prepared (``adopt_target``): the target is timed once."""
        drafting = dec.drafter_of("draft-model") or dec.drafter_of("layer-skip")
        model = drafting.model if drafting is not None else dec.target
        # the wrapped weights and how they run (a float target gets a fresh wrapper per decoder)
        key = (id(getattr(model, "hf_model", model)), getattr(model, "backend", None), id(dec.target.hf_model),
               dec.target.backend, dec.pads)
        cost = self._costs.get(key)
        if cost is None:
            cost = controller_cost(dec)
            for other in self._costs.values():  # the target's timings, where one of them prepared it
                if cost.adopt_target(other):
                    break
            self._costs[key] = cost
        return cost

    def prepare(self, strategies: list[Strategy]) -> None:
        """Build the decoders of ``strategies`` (plain decoding included) and time their
        controllers' cost models now (while ``/health`` says loading), not in a request (the
        target once: ``cost``)."""
        if self.settings is None:
            return
        for strategy in dict.fromkeys([PLAIN, *strategies]):
            if self.decoders.servable(strategy) is not None:
                continue
            cost = self.cost(self.decoders.decoder(strategy))
            with torch.inference_mode():
                cost.prepare()

    def unknown_start(self, default: Strategy) -> Strategy:
        """What a request far from every stored task starts on (with no general entry stored):
        ``default``, the server's untuned draft, where this server's measured cost model expects
        it to beat plain decoding alone at ``DEFAULT_ACCEPTANCE``, else plain decoding. The prior of
        a server that has seen nothing yet: ``live_start`` replaces it once requests measured."""
        if not default.speculates or self.decoders.servable(default) is not None:
            return PLAIN
        dec = self.decoders.decoder(default)
        cost = self.cost(dec) if self.settings is not None else controller_cost(dec)
        return default if self._pays(cost, default, DEFAULT_ACCEPTANCE) else PLAIN

    def live_start(self, job: Job, strategy: Strategy, dec: Decoder) -> Strategy | None:
        """Where an ``unknown`` request decoding ``strategy`` starts, from the live acceptance of
        similar requests (its cluster's, else every ``unknown`` request's): ``strategy`` where it
        pays alone at that acceptance, else plain decoding; None with no live figure yet (the
        start-up judgement stands) and for any other route (its controller's prior decides)."""
        if job.choice.route != UNKNOWN or not strategy.speculates:
            return None
        keys = live_keys(job)[::-1]  # the cluster's first
        live = next((a for a in (self.acceptance.get(k, strategy) for k in keys) if a is not None), None)
        if live is None:
            return None
        return strategy if self._pays(self.cost(dec), strategy, live) else PLAIN

    def _pays(self, cost: MeasuredCostModel, strategy: Strategy, acceptance: float) -> bool:
        """Whether ``strategy`` decoding alone beats plain decoding at ``acceptance`` by the switch
        margin, priced by ``cost``."""
        margin = (self.settings or ControlSettings()).margin
        with torch.inference_mode():
            per_token = cost.draft_forward_s(strategy.layer_plan) if strategy.drafter != "prompt-lookup" else 0.0
            return pays_alone(Candidate.of(strategy, acceptance, per_token), cost.verify_s, cost.plain_step_s(),
                              stops_early=strategy.confidence_threshold > 0 and not strategy.tree_widths, margin=margin)

    def controller(self, job: Job, strategy: Strategy, dec: Decoder) -> RequestController | None:
        """``job``'s controller, starting where its route's latest requests mostly ended; None for
        an explicit choice, a request re-tuning its route and one this server cannot run."""
        if self.settings is None or job.choice.route in EXPLICIT_ROUTES or job.choice.state != "stored":
            return None
        start = self.live_start(job, strategy, dec) or \
            self.priors.start(job.choice.route, strategy, decoder_options(strategy, dec, self.settings),
                              job.choice.distance)
        return RequestController(strategy, dec, self.cost(dec), len(job.ids), self.settings, self.kind(job),
                                 start=start, max_new_tokens=job.cfg.max_new_tokens)

    @staticmethod
    def before_round(batch: list[Running]) -> None:
        """Each controlled request's controller, before the step's round (it may switch strategy).
        A request that the load-aware choice kept from drafting in the last step of a batch skips
        it: its decisions choose among drafts it is not running."""
        alone = len(batch) == 1
        for r in batch:
            if r.control is None or (not alone and r.member.decoder.step_cap == 0):
                continue
            seq = r.member.seq
            try:
                r.control.before_round(r.member.decoder, seq.prompt + seq.out, seq.cache, seq.stats, alone=alone,
                                       batch=len(batch))
            except Exception:  # its strategy stays what it was; the request goes on, uncontrolled
                log.exception("a request's controller failed; it keeps decoding with %s", r.current.to_json())
                r.member.decoder.apply(r.current)
                r.control = None

    def finished(self, r: Running, decode_s: float, on_control: Any) -> None:
        """``r``'s controller is done: its summary on the job, and where it ended teaches its route."""
        if r.control is None:
            return
        seq = r.member.seq
        try:  # its last stretch teaches the corrections too; a failure here must not fail the answer
            r.control.finish(seq.prompt + seq.out, seq.stats)
        except Exception:
            log.exception("a request's controller failed to account its last rounds; its answer goes out")
        r.job.control = r.control.summary(decode_s=decode_s)
        # a request too short to decide says nothing about its route, and ``unknown`` is every
        # unseen kind at once: what one kind ended on is no prior for the next
        if r.control.decisions and r.job.choice.route != UNKNOWN:
            self.priors.observe(r.job.choice.route, r.control.current, r.job.choice.distance)
        if on_control is not None:
            on_control(r.job)
