"""What the decode worker has measured of this machine and its routes: a batched target step's price,
each draft model's depth forward, each drafter's catch-up and per-token price, and each route's live
acceptance. The step planner (``planner``) reads them; the decode loop refines them every step."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autotune.tuning.load import CatchUpCost, DraftCost, RouteAcceptance, StepCost
from runtime.decoding import Decoder


@dataclass
class CostFigures:
    """The figures the step planner prices a step with (all learned while serving)."""

    step_cost: StepCost = field(default_factory=StepCost)  # a batched forward's price (start-up profile, then steps)
    # each draft model's depth forwards in a batched step, by its weights (``draft_key``): one
    # forward per depth for every sequence drafting there
    draft_costs: dict[str, DraftCost] = field(default_factory=dict)
    # a drafting model's catch-up over a sequence (its prompt and first tokens), by drafter kind:
    # what starting to draft costs a request
    catch_ups: dict[str, CatchUpCost] = field(default_factory=dict)
    draft_token_s: dict[str, float] = field(default_factory=dict)  # seconds per drafted token, by drafter kind
    # each route's live acceptance per strategy: the goodput choice's prior (``/health`` shows it)
    acceptance: RouteAcceptance = field(default_factory=RouteAcceptance)

    def observe_drafting(self, batch: list[Any], drafted: list[int], seconds: float) -> None:
        """A step's drafting (``drafted`` tokens per request of ``batch``, ``seconds`` in all), for
        the draft model's depth price: where every sequence that drafted ran a chain of one draft
        model, its depths are the longest chain."""
        drafting = [(r, n) for r, n in zip(batch, drafted) if n > 0]
        keys = {draft_key(r.member.decoder) for r, _ in drafting}
        if not drafting or len(keys) != 1 or None in keys or any(
                r.current.drafter != "draft-model" or r.current.tree_widths or r.current.dynamic_widths
                for r, _ in drafting):  # (a lookup copy drafts free, though its decoder holds a draft model)
            return
        chains = [n for _, n in drafting]
        self.draft_costs.setdefault(keys.pop(), DraftCost()).observe(max(chains), sum(chains), seconds)

    def observe_catch_up(self, drafter: str, tokens: int, seconds: float) -> None:
        """A drafting model caught up on ``tokens`` of a sequence in ``seconds``."""
        self.catch_ups.setdefault(drafter, CatchUpCost()).observe(tokens, seconds)

    def observe_finished(self, keys: list[str], r: Any) -> None:
        """``r`` left its batch: where one speculative strategy did all its drafting (it may have
        switched to plain decoding since), its per-token draft price, and its acceptance under each
        of ``keys`` (its route, its pending cluster: ``jobs.live_keys``; a request shorter than any
        window too: the next one of its kind starts from it)."""
        stats = r.member.seq.stats
        drafted_with = _one_drafting(r)
        if stats.drafted and drafted_with is not None:
            self.draft_token_s[drafted_with.drafter] = stats.draft_s / stats.drafted
            for key in keys:
                self.acceptance.observe(key, drafted_with, stats.accepted, stats.drafted)


def _one_drafting(r: Any) -> Any:
    """The one speculative strategy that drafted all of ``r``'s drafts (None: several, or none):
    its start (its route's moved prior, maybe not its decoder's key) when every switch since went
    to plain decoding."""
    control = r.control
    if control is None:
        return r.current if r.current.speculates else None
    start = control.started_with
    if start.speculates and all(not d.switched or d.chose == "plain" for d in control.decisions):
        return start
    return None


def draft_key(decoder: Decoder) -> str | None:
    """Which draft model's weights ``decoder`` drafts with (its draft-model drafter, drafting or on
    standby; None: none): sequences with the same key run each draft depth as one forward
    (``runtime.batching.draft_together`` groups them by the same weights)."""
    drafter = decoder.drafter_of("draft-model")
    if drafter is None:
        return None
    model = drafter.model
    return f"draft-model:{id(getattr(model, 'linears', model))}:{id(getattr(model, 'head', model))}"
