"""Which precision would be fastest for a study's workload: its stored strategy's measured rounds,
re-priced with the target step timed at each precision this device runs.

A round of the stored strategy costs its measured draft time plus its verify time; at another
precision the draft is unchanged (its precision is the strategy's) and the verify scales with the
target's step at the verify width. Plain decoding scales with the one-row step. Acceptance is taken
as equal across precisions (each verifies the same drafts against a close model): a prediction,
said so where it is shown.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from autotune.tuning.cost_model import forward_seconds
from runtime.errors import RuntimeUserError
from runtime.loading import LoadedModel
from runtime.pipeline import ModelPool
from runtime.precision import PRECISIONS, get_precision
from runtime.stats import DecodeStats

# the precisions compared besides the study's own (float32's packed verify copy of a large target
# costs its whole size again, and it is the slowest on every CPU measured: compared only when current)
CANDIDATES = ("int8", "int4", "w8a8")


@dataclass(frozen=True)
class PrecisionEstimate:
    precision: str
    plain_tps: float  # predicted plain decoding speed (decode rounds)
    chosen_tps: float  # predicted speed of the stored strategy
    current: bool  # the precision the study ran at (its figures are measured, not predicted)


def _runnable(device: str) -> list[str]:
    out = []
    for name in CANDIDATES:
        try:
            get_precision(name, device)
        except RuntimeUserError:
            continue
        out.append(name)
    return out


def _step_s(pool: ModelPool, target: LoadedModel, precision: str, rows: int, context: int) -> float:
    """The target's forward over ``rows`` rows at ``precision``, as a decoder runs it."""
    from runtime.pipeline import verify_backend

    model = pool.get(target.name, precision)
    lm = pool.served(model)
    backend = verify_backend(pool.device)
    if rows > 1 and lm.backend == "dense" and backend != "dense" and lm.dtype == torch.float32:
        lm = pool.target_for_width(model, backend, rows)
    return forward_seconds(lm, rows, context)


def estimate(
    pool: ModelPool, target: LoadedModel, stats: DecodeStats, width: int, context: int,
    candidates: tuple[str, ...] | None = None,
) -> list[PrecisionEstimate]:
    """Predicted plain and stored-strategy speed at each precision (``stats``: the stored strategy's
    measured decode; ``width``: its verify rows, 1 for plain decoding)."""
    names = list(candidates or _runnable(pool.device))
    if target.precision not in names:
        names.insert(0, target.precision)
    one = {p: _step_s(pool, target, p, 1, context) for p in names}
    wide = {p: (_step_s(pool, target, p, width, context) if width > 1 else one[p]) for p in names}
    cur = target.precision
    tokens = max(stats.new_tokens - 1, 1)  # the prefill's token is not a round's
    out = []
    for p in names:
        verify_s = stats.verify_s * wide[p] / wide[cur]
        chosen = tokens / (stats.draft_s + verify_s) if stats.draft_s + verify_s > 0 else 0.0
        out.append(PrecisionEstimate(p, 1.0 / one[p], chosen, p == cur))
    return out


def advice(estimates: list[PrecisionEstimate]) -> dict[str, Any]:
    """The fastest precision for the stored strategy and for plain decoding, with every estimate."""
    best = max(estimates, key=lambda e: e.chosen_tps)
    plain = max(estimates, key=lambda e: e.plain_tps)
    return {"fastest": best.precision, "fastest_plain": plain.precision, "estimates": [asdict(e) for e in estimates]}
