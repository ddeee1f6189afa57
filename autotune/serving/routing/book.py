"""Which strategy each request decodes with: the override, or the route of its prompt.

The book holds the stored best strategies of the served model / draft / hardware and a router
fitted on the prompts each was tuned on (``autotune.serving.routing.router``). ``auto`` routes a request
to the nearest task's strategy; a request far from every task is the route ``unknown``, which
decodes with the store's strategy for the task ``prompts`` (ad-hoc, general prompts: ``autotune
study --task prompts --data FILE``), the measured general-purpose choice, else with ``fallback``:
plain decoding, or the server's default draft where its cost model expects that to pay
(``Control.unknown_start``).
``plain`` and ``default`` bypass routing; a number picks a stored strategy by id.
"""
from __future__ import annotations

import threading
from typing import Any

from autotune.serving.protocol import ApiError
from autotune.serving.routing.router import DEFAULT_ROUTE_DISTANCE, UNKNOWN, RouteEntry, TaskRouter
from autotune.serving.jobs import Choice
from autotune.store.hardware import hardware_fingerprint
from autotune.store.resolve import PROMPT_TASK
from search_spaces.errors import StrategyError
from search_spaces.strategy import PLAIN, Strategy

GENERAL_TASK = PROMPT_TASK


class StrategyBook:
    def __init__(self, storage: Any, target: Any, draft: str | None, device: str, metrics: Any,
                 threshold: float | None = None) -> None:
        self.storage, self.metrics = storage, metrics
        self.scope = dict(model_id=target.model_id, model_revision=target.revision, draft_id=draft or "",
                          hardware=hardware_fingerprint(device))
        self.default = Strategy() if draft else PLAIN
        self.fallback = PLAIN  # ``unknown`` without a general entry: PLAIN or ``default`` (set at start-up)
        self.router = TaskRouter(DEFAULT_ROUTE_DISTANCE if threshold is None else threshold)
        self.general: RouteEntry | None = None
        self.entries: list[RouteEntry] = []
        self._version: Any = None
        self.skipped: dict[int, str] = {}  # stored rows that could not be read: id -> why
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ the store
    def refresh(self) -> None:
        """Read this model's stored strategies and their prompts; refit the router."""
        version = self.storage.version(**self.scope)
        entries = []
        for best, prompts in self.storage.routes(**self.scope):
            try:
                entries.append(RouteEntry(task=best.key.task, best_id=best.id, strategy=best.strategy,
                                          prompts=tuple(prompts), acceptance=best.acceptance,
                                          history_id=best.history_id))
            except StrategyError as exc:  # a row this version cannot read is skipped, not fatal
                self.skipped[best.id] = str(exc)
        router = TaskRouter(self.router.threshold, self.router.reach_slack)
        router.fit(entries)
        general = next((e for e in entries if e.task == GENERAL_TASK), None)
        with self._lock:
            self.entries, self.router, self.general, self._version = entries, router, general, version
        for e in entries:
            self.metrics.set_strategy(e.task, self._label(e), e.strategy.to_json())
        self.metrics.set_strategy(UNKNOWN, *self._unknown(general))

    def use_fallback(self, strategy: Strategy) -> None:
        """``unknown`` requests decode with ``strategy`` (plain or the default) when no general entry is stored."""
        self.fallback = strategy
        with self._lock:
            general = self.general
        self.metrics.set_strategy(UNKNOWN, *self._unknown(general))

    def _unknown(self, general: RouteEntry | None) -> tuple[str, str]:
        """(label, strategy JSON) of the route ``unknown``."""
        if general is not None:
            return self._label(general), general.strategy.to_json()
        return self._fallback_label(self.fallback), self.fallback.to_json()

    @staticmethod
    def _fallback_label(fallback: Strategy) -> str:
        return "default" if fallback.speculates else "plain"

    def refresh_if_changed(self) -> bool:
        if self.storage.version(**self.scope) == self._version:
            return False
        self.refresh()
        return True

    def strategies(self) -> list[Strategy]:
        """Every strategy a request may be routed to (to build their decoders at start-up)."""
        return list(dict.fromkeys([PLAIN, self.default, *(e.strategy for e in self.entries)]))

    def describe(self) -> list[str]:
        with self._lock:
            general = self.general
        return [f"{e.task} -> {self._label(e)}" for e in self.entries] + \
            [f"{UNKNOWN} -> {self._unknown(general)[0]}"] + \
            [f"stored strategy {i} skipped ({why})" for i, why in self.skipped.items()]

    # ------------------------------------------------------------------ per request
    def choose(self, text: str, override: str) -> Choice:
        if override == "plain":
            return Choice("plain", PLAIN, "plain")
        if override == "default":
            return Choice("default", self.default, "default" if self.default.speculates else "plain")
        if override != "auto":
            return self._by_id(int(override))
        with self._lock:
            router, general = self.router, self.general
        decision = router.route(text)
        if decision.entry is not None:
            return Choice(decision.route, decision.entry.strategy, self._label(decision.entry), decision.distance,
                          decision.entry)
        if general is not None:
            return Choice(UNKNOWN, general.strategy, self._label(general), decision.distance, general)
        fallback = self.fallback
        return Choice(UNKNOWN, fallback, self._fallback_label(fallback), decision.distance)

    def tasks(self) -> list[str]:
        """The stored tasks requests are routed to (``/health``; safe from any thread)."""
        with self._lock:
            return [e.task for e in self.entries]

    def needs_lookup(self, override: str) -> bool:
        """Whether choosing for ``override`` reads the store (an explicit id not routed to)."""
        if override in ("auto", "plain", "default"):
            return False
        with self._lock:
            return all(str(e.best_id) != override for e in self.entries)

    def _by_id(self, best_id: int) -> Choice:
        with self._lock:
            known = next((e for e in self.entries if e.best_id == best_id), None)
        if known is not None:  # routed to: no store read
            return Choice("id", known.strategy, str(best_id))
        row = self.storage.get(best_id)
        if row is None:
            raise ApiError(400, f"no stored strategy with id {best_id}; `autotune strategies list` shows them",
                           "autotune.strategy", code="unknown_strategy")
        theirs = dict(model_id=row.key.model_id, model_revision=row.key.model_revision, draft_id=row.key.draft_id,
                      hardware=row.key.hardware)
        if theirs != self.scope:
            # what the row was tuned for stays unsaid: another key's model is no business of this client
            raise ApiError(400, f"stored strategy {best_id} was tuned for another model, draft or hardware; this "
                           f"server runs {self.scope['model_id']} with draft '{self.scope['draft_id']}' on "
                           f"{self.scope['hardware']}", "autotune.strategy", code="strategy_mismatch")
        return Choice("id", row.strategy, str(best_id))

    @staticmethod
    def _label(entry: RouteEntry | None) -> str:
        """A stored strategy's id (it may itself be plain decoding: a study that found nothing faster)."""
        return "plain" if entry is None else str(entry.best_id)
