"""The step planner: from the running batch and the measured cost figures, each request's draft length
and tree width this step (``autotune.tuning.load``). Pure: it reads the batch and the figures and
changes neither."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from autotune.serving.costs import CostFigures, draft_key
from autotune.tuning.load import Candidate, acceptance_estimate, choose_shapes, starts_alone, strategy_rows
from search_spaces.strategy import Strategy

DRAFT_TOKEN_SHARE = 0.3  # a drafted token's price before any was timed, as a share of a one-row target step


@dataclass(frozen=True)
class StepShape:
    """One request's draft this step: its length cap (None: its strategy's; 0: none) and tree width."""

    length: int | None
    width: int | None = None


def plan_step(batch: Sequence[Any], figures: CostFigures, max_rows: int | None, load_aware: bool) -> list[StepShape]:
    """Each request's shape this step: its strategy's (fitted to ``max_rows``) when not
    ``load_aware`` or alone, the goodput-maximising ones in a batch. Either way a request whose
    drafting model has yet to catch up on its sequence drafts only where that pays back."""
    if not load_aware:
        return [StepShape(fit_rows(r.current, max_rows)) for r in batch]
    candidates = [candidate(r, figures) for r in batch]
    if len(batch) == 1:
        r = batch[0]
        return [StepShape(fit_rows(r.current, max_rows) if starts_alone(candidates[0], figures.step_cost) else 0)]
    return [StepShape(s.length, s.width) for s in choose_shapes(candidates, figures.step_cost, max_rows)]


def candidate(r: Any, figures: CostFigures) -> Candidate:
    """``r``'s options this step for the goodput choice (``autotune.tuning.load.Candidate``): its
    route's live acceptance (else the stored one), its drafting's price, and its catch-up's."""
    s, seq = r.current, r.member.seq
    stats = seq.stats
    entry = r.job.choice.entry
    prior = figures.acceptance.get(r.job.choice.route, s)  # the route's live figure, else the stored one
    if prior is None and entry is not None and r.job.choice.state == "stored":
        prior = entry.acceptance
    fixed, group = 0.0, None
    key = draft_key(r.member.decoder) if s.drafter == "draft-model" else None
    shared = figures.draft_costs.get(key) if key is not None else None
    if shared is not None and shared.known:  # batch-mates drafting with its weights share each depth's forward
        per_token, fixed, group = shared.per_seq, shared.fixed, key
    else:
        per_token = stats.draft_s / stats.drafted if stats.drafted else figures.draft_token_s.get(s.drafter)
        if per_token is None:
            per_token = DRAFT_TOKEN_SHARE * figures.step_cost.predict(1, 1)
    catch_up = figures.catch_ups.get(s.drafter) if s.speculates and not r.drafter_synced else None
    return Candidate.of(s, acceptance_estimate(prior, stats.accepted, stats.drafted), per_token,
                        start_s=catch_up.predict(r.member.decoder.catch_up_rows()) if catch_up is not None else 0.0,
                        remaining=seq.config.max_new_tokens - len(seq.out), draft_fixed_s=fixed, draft_group=group)


def fit_rows(strategy: Strategy, max_rows: int | None) -> int | None:
    """The longest draft of ``strategy`` whose verify fits ``max_rows`` rows (None: no cap needed)."""
    if max_rows is None or not strategy.speculates:
        return None
    rows = strategy_rows(strategy)
    k = strategy.draft_length
    while k > 0 and rows(k) > max_rows:
        k -= 1
    return None if k == strategy.draft_length else k
