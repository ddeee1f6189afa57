"""Which precision would be fastest for a study's workload: its stored strategy's measured rounds,
re-priced with the target step timed at each precision this device runs.

A round of the stored strategy costs its measured draft time plus its verify time; at another
precision the draft is unchanged (its precision is the strategy's) and the verify scales with the
target's forwards over the rows the rounds verified (``DecodeStats.verify_rows``: 1 + drafted,
round by round), each timed as a decoder at that precision runs it: a float32 target packed for
the verify width runs every verify at that width; the quantised kernels run the round's own rows,
whose cost rises in blocks (torch's int4 kernel: 4 rows a block), so a row count between two timed
ones is priced at the next timed one. Plain decoding scales with the one-row step. Acceptance is
taken as equal across precisions (each verifies the same drafts against a close model): a
prediction, said so where it is shown.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from autotune.tuning.cost_model import forward_seconds
from runtime.errors import RuntimeUserError
from runtime.loading import LoadedModel
from runtime.machine import available_memory
from runtime.pipeline import ModelPool
from runtime.precision import PRECISIONS, get_precision
from runtime.stats import DecodeStats

# the precisions compared besides the study's own (float32's packed verify copy of a large target
# costs its whole size again, and it is the slowest on every CPU measured: compared only when current)
CANDIDATES = ("int8", "int4", "w8a8", "gguf")


@dataclass(frozen=True)
class PrecisionEstimate:
    precision: str
    plain_tps: float  # predicted plain decoding speed (decode rounds)
    chosen_tps: float  # predicted speed of the stored strategy
    current: bool  # the precision the study ran at (its figures are measured, not predicted)


def runnable(device: str) -> list[str]:
    """The candidates this device can run."""
    out = []
    for name in CANDIDATES:
        try:
            get_precision(name, device)
        except RuntimeUserError:
            continue
        out.append(name)
    return out


def timed_rows(rows: int) -> int:
    """The row count timed to price a verify of ``rows`` rows: 1-4 themselves, then the next
    multiple of 4 (a quantised verify's cost rises in blocks of rows; between two timed counts the
    dearer one prices it)."""
    return rows if rows <= 4 else -(-rows // 4) * 4


class _Steps:
    """The target's forward over r rows at each precision, timed once per (precision, rows), as a
    decoder at that precision runs it (a float32 target packed for ``width`` pads to it)."""

    def __init__(self, pool: ModelPool, target: LoadedModel, width: int, context: int) -> None:
        self.pool, self.target, self.width, self.context = pool, target, width, context
        self._s: dict[tuple[str, int], float] = {}

    def seconds(self, precision: str, rows: int) -> float:
        from runtime.pipeline import verify_packing

        model = self.pool.get(self.target.name, precision)
        lm = self.pool.served(model)
        backend = verify_packing(lm, self.pool.device, self.pool.compile)
        if rows > 1 and backend is not None:
            rows = max(self.width, 2)  # packed for the verify width: every verify runs it
            lm = self.pool.target_for_width(model, backend, rows)
        else:
            rows = min(timed_rows(rows), max(self.width, rows))
        key = (precision, rows)
        if key not in self._s:
            self._s[key] = forward_seconds(lm, rows, self.context, repeats=3, every_logit=rows > 1)
        return self._s[key]

    def verifies(self, precision: str, rows_hist: list[int]) -> float:
        """Seconds of the verifies of ``rows_hist`` (rounds by rows) at ``precision``."""
        return sum(n * self.seconds(precision, r) for r, n in enumerate(rows_hist) if n and r >= 1)


# a float-weight candidate's tree (float32) plus its quantised copy, as a share of the float32 tree
FLOAT_TREE_FACTOR = 1.3


def float_tree_bytes(target: LoadedModel) -> int:
    """Bytes of ``target``'s weights as a float32 tree (its embedding included, wherever it lives)."""
    tree = target.hf_model
    n = sum(p.numel() for p in tree.parameters())
    embed = tree.get_input_embeddings()
    untied = not getattr(tree.config, "tie_word_embeddings", False)  # a tied head's weight is counted already
    if untied and not any(True for _ in embed.parameters()):  # rows looked up in GGUF blocks (runtime.gguf_model)
        n += embed.num_embeddings * embed.k
    return 4 * n


def untimed(target: LoadedModel, candidates: list[str]) -> dict[str, str]:
    """Candidates not timed, with why: a target loaded from its GGUF blocks alone (``gguf``) has no
    float tree, and the float-weight precisions need one; they are timed only where it, and its
    quantised copy, fit in the memory available now (an 8B model's would not fit in 24 GiB)."""
    if not target.blocks_only:
        return {}
    need, free = FLOAT_TREE_FACTOR * float_tree_bytes(target), available_memory()
    if free is None or need <= free:
        return {}
    why = f"its float32 tree needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB is available"
    return {p: why for p in candidates if p != target.precision and not PRECISIONS[p].blocks_only}


def estimate(
    pool: ModelPool, target: LoadedModel, stats: DecodeStats, width: int, context: int,
    candidates: tuple[str, ...] | None = None,
) -> list[PrecisionEstimate]:
    """Predicted plain and stored-strategy speed at each precision (``stats``: the stored strategy's
    measured decode, its rounds by rows in ``verify_rows``; ``width``: its verify width, 1 for plain
    decoding; ``candidates``: the precisions to time, by default every ``runnable`` one)."""
    names = list(candidates or runnable(pool.device))
    if target.precision not in names:
        names.insert(0, target.precision)
    steps = _Steps(pool, target, width, context)
    rows_hist = list(stats.verify_rows) if width > 1 and stats.verify_rows else []
    if width > 1 and not rows_hist:  # rounds not counted by rows: every one priced at the full width
        rows_hist = [0] * width + [max(stats.target_forwards - 1, 1)]
    cur = target.precision
    verify_at = {p: steps.verifies(p, rows_hist) for p in names} if rows_hist else {}
    tokens = max(stats.new_tokens - 1, 1)  # the prefill's token is not a round's
    out = []
    for p in names:
        verify_s = stats.verify_s * verify_at[p] / verify_at[cur] if verify_at else \
            stats.verify_s * steps.seconds(p, 1) / steps.seconds(cur, 1)
        chosen = tokens / (stats.draft_s + verify_s) if stats.draft_s + verify_s > 0 else 0.0
        out.append(PrecisionEstimate(p, 1.0 / steps.seconds(p, 1), chosen, p == cur))
    return out


def advice(estimates: list[PrecisionEstimate], not_timed: dict[str, str] | None = None) -> dict[str, Any]:
    """The fastest precision for the stored strategy and for plain decoding, with every estimate
    (and the candidates not timed, with why: ``untimed``)."""
    best = max(estimates, key=lambda e: e.chosen_tps)
    plain = max(estimates, key=lambda e: e.plain_tps)
    return {"fastest": best.precision, "fastest_plain": plain.precision, "estimates": [asdict(e) for e in estimates],
            "not_timed": dict(not_timed or {})}
