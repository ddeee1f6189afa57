"""A measured cost model: seconds per draft forward (per layer plan) and per target verify.

Nothing is assumed: each number is timed on this machine with the real models, and refreshed
from the timings the decoder records while it decodes with the incumbent strategy.

- Skip-only plans: ``t = base + n_attn * attn + n_mlp * mlp`` over the sub-layers a plan runs,
  fitted from three timed plans (all layers; all inner attention skipped; all inner MLPs skipped).
- Plans with layer-parallel groups: timed directly, once per plan (their cost is not additive).
- Bonus calibration's exact catch-up over several rows: linear in rows, from 1 and verify-width rows.
- Verify: the verify rounds seen while decoding; before any, the faster of two timed forwards at
  the fixed width (a first wide forward is often slower than later ones, and a single noisy timing
  would price every draft out of the race: no drafted round would ever correct it). A decoder
  that does not pad (``padded=False``: a quantised target, whose verify cost grows with every
  row) verifies its drafted rows only: a round of ``r`` rows costs a forward of ``r`` rows, timed
  once per row count when first priced (the plain step at 1 row; measured rounds of any width
  rescale them all). Not a line through two widths: the int4 kernel runs rows in blocks of 4, so
  its verify cost steps at every fifth row. Verify rounds seen while decoding price their row
  count (the median of the latest), and no row count is priced above a wider one: noise only
  ever adds time.
- Plain decoding: the median of the plain steps seen while decoding (the latest
  ``PLAIN_OBSERVED``, with the faster of two timed single-token forwards, or the kept figure, as one
  vote), so a burst of load on the machine moves it only while it lasts; and never above a
  two-row verify's price (a forward of more rows does more work: a plain step timed slower than
  that is noise, and the verify rounds seen while decoding keep correcting that price).
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from autotune.timing import Stopwatch, time_calls
from runtime.transformer import CausalLM
from search_spaces.layer_plan import LayerPlan

EMA = 0.2  # weight of a new observation in the refreshed correction factors
VERIFY_TIMINGS = 2  # timed verify forwards before any verify round was seen (the least counts)
PLAIN_OBSERVED = 16  # the latest plain steps (verify rounds of one row count) seen whose median prices them
SEEN_MIN = 3  # verify rounds of one row count seen before their median replaces its timing


class CostModel(Protocol):
    def draft_forward_s(self, plan: LayerPlan | None) -> float: ...

    def catch_up_s(self, rows: float) -> float: ...

    def verify_s(self, rows: float | None = None) -> float: ...

    def plain_step_s(self) -> float: ...

    def observe_draft(self, predicted_s: float, measured_s: float) -> None: ...

    def observe_verify(self, measured_s: float, rows: float | None = None) -> None: ...

    def observe_plain(self, measured_s: float) -> None: ...


def forward_seconds(lm: CausalLM, rows: int, context: int, repeats: int = 5, every_logit: bool = False) -> float:
    """One forward of ``rows`` tokens after ``context`` cached ones (median of ``repeats``, after a
    warm-up call); the cache contents are zeros (timing only). ``every_logit``: the head on every
    row, as a verify runs it."""
    cache = lm.new_cache(context + rows + 1)
    ids = torch.zeros(rows, dtype=torch.long, device=lm.device)

    def rewind() -> None:
        cache.length = context

    def step() -> None:
        with torch.inference_mode():
            lm(ids, cache, logits_for=None if every_logit else slice(-1, None))

    return time_calls(step, repeats, lm.device, setup=rewind).median


@dataclass
class MeasuredCostModel:
    """Times forwards of ``draft`` (the drafting model) and ``target`` at ``verify_width`` rows
    over a context of ``context`` tokens."""

    draft: CausalLM
    target: CausalLM
    verify_width: int
    context: int = 256
    repeats: int = 3
    warm: bool = True  # one untimed forward first (a tuner timing models that are already decoding needs none)
    padded: bool = True  # every verify runs ``verify_width`` rows (else: its drafted rows; ``verify_s``)
    draft_scale: float = 1.0  # measured / predicted, refreshed while decoding
    verify_scale: float = 1.0
    _linear: tuple[float, float, float] | None = None  # base, per attention, per MLP
    _rows: tuple[float, float] | None = None  # exact draft forward: one row, each further row
    _by_plan: dict[LayerPlan | None, float] = field(default_factory=dict)
    _verify: float | None = None
    _width: dict[int, float] = field(default_factory=dict)  # unpadded verifies: seconds by row count (timed)
    _seen: dict[int, deque] = field(default_factory=dict)  # unpadded verify rounds seen while decoding, by row count
    _table: dict[int, float] | None = None  # the priced row counts (``_envelope``), until the next change
    _plain: float | None = None  # the timed or kept plain step, then the median of those seen (``observe_plain``)
    _plain_seen: deque = field(default_factory=lambda: deque(maxlen=PLAIN_OBSERVED))
    _full: float | None = None  # one exact single-row draft forward (``_full_s``)
    _target_timed: bool = False  # ``prepare`` timed the target's row counts and plain step again (or adopted them)
    _calibrating: Stopwatch = field(default_factory=Stopwatch)

    @property
    def calibration_s(self) -> float:
        """Seconds spent timing forwards so far (one-time: the timings are kept in the store)."""
        return self._calibrating.seconds

    def _forward_s(self, lm: CausalLM, rows: int, plan: LayerPlan | None, best_of: int = 1,
                   every_logit: bool = False) -> float:
        """Seconds of one forward of ``rows`` tokens after ``context`` (the median of ``repeats``;
        the least of ``best_of`` such timings: noise only ever adds time). ``every_logit``: the
        head runs on every row, as a verify's does (a draft step needs its last row's only); on a
        1.5B target with a 152k vocabulary that is ~25% of a 13-row verify."""
        with self._calibrating:
            cache = lm.new_cache(self.context + rows + 1)
            ids = torch.zeros(rows, dtype=torch.long, device=lm.device)

            def rewind() -> None:
                cache.length = self.context  # timing only: the contents do not matter

            def step() -> None:
                with torch.inference_mode():
                    lm(ids, cache, plan=plan, logits_for=None if every_logit else slice(-1, None))

            # one untimed warm-up (when asked) before the first timing only: it pays the first-call costs
            return min(time_calls(step, self.repeats, lm.device, self.warm and i == 0, rewind).median
                       for i in range(best_of))

    def _full_s(self) -> float:
        """One exact single-row draft forward, timed once (the faster of two: a first forward of a
        model just loaded pays one-time costs): all a plan without skipped sub-layers needs."""
        if self._full is None:
            self._full = self._forward_s(self.draft, 1, None, best_of=VERIFY_TIMINGS)
        return self._full

    def _fit(self) -> tuple[float, float, float]:
        """The forward's split into a base, each attention and each MLP sub-layer (two more timed
        forwards): only plans that skip sub-layers need it."""
        if self._linear is None:
            n = self.draft.dims.n_layers
            inner = tuple(range(1, n - 1))
            full = self._full_s()
            no_attn = self._forward_s(self.draft, 1, LayerPlan(n, skip_attn=inner)) if inner else full
            no_mlp = self._forward_s(self.draft, 1, LayerPlan(n, skip_mlp=inner)) if inner else full
            k = max(len(inner), 1)
            attn, mlp = max(full - no_attn, 0.0) / k, max(full - no_mlp, 0.0) / k
            if n * (attn + mlp) > full:  # timing noise: keep the full plan's prediction == its timing
                attn, mlp = (x * full / (n * (attn + mlp)) for x in (attn, mlp))
            self._linear = (full - n * (attn + mlp), attn, mlp)
        return self._linear

    def catch_up_s(self, rows: float) -> float:
        """An exact draft forward over ``rows`` tokens: with bonus calibration every round starts
        by re-running its accepted tokens + the bonus token (a wider GEMM than one draft step)."""
        if self._rows is None:
            full = self._full_s()
            wide = max(self.verify_width, 2)
            wide_s = self._forward_s(self.draft, wide, None, best_of=VERIFY_TIMINGS)
            self._rows = (min(full, wide_s), max(wide_s - full, 0.0) / (wide - 1))
        one, per_row = self._rows
        return (one + max(rows - 1.0, 0.0) * per_row) * self.draft_scale

    def draft_forward_s(self, plan: LayerPlan | None) -> float:
        if plan is not None and plan.groups:
            if plan not in self._by_plan:
                self._by_plan[plan] = self._forward_s(self.draft, 1, plan)
            return self._by_plan[plan] * self.draft_scale
        if plan is None or not (plan.skip_attn or plan.skip_mlp):
            return self._full_s() * self.draft_scale
        base, attn, mlp = self._fit()
        n = self.draft.dims.n_layers
        return (base + (n - len(plan.skip_attn)) * attn + (n - len(plan.skip_mlp)) * mlp) * self.draft_scale

    def verify_s(self, rows: float | None = None) -> float:
        """A verify round (of ``rows`` target rows, 1 + the drafted tokens, where the decoder does
        not pad; default: the full width). Padded: the first one seen while decoding, else the
        faster of two timed forwards (one-time costs of the first wide forward and noise would make
        it pessimistic), times the scale decode rounds refresh. Unpadded: the row counts either
        side of ``rows`` (``_price``), interpolated."""
        if self.padded or rows is None or self.verify_width <= 1:
            return self._verify_rows(None) * self.verify_scale
        rows = min(max(rows, 1.0), float(self.verify_width))
        lo = int(rows)
        below = self._price(lo)
        return below if rows == lo else below + (rows - lo) * (self._price(lo + 1) - below)

    def _price(self, rows: int) -> float:
        """An unpadded verify of exactly ``rows`` rows, in decode seconds: the plain step at 1, else
        ``_envelope``'s (a row count not timed yet is timed now, once)."""
        if rows <= 1:
            return self.plain_step_s()
        rows = min(rows, self.verify_width)
        if rows < self.verify_width and rows not in self._width:
            self._width[rows] = self._forward_s(self.target, rows, None, every_logit=True)
            self._table = None
        if self._table is None:
            self._table = self._envelope()
        return self._table[rows]

    def _envelope(self) -> dict[int, float]:
        """Every row count timed: the median of the verify rounds of that count seen while decoding
        (``SEEN_MIN`` or more of the latest ``PLAIN_OBSERVED``), else its timing times the scale;
        and never above a wider count's price (more rows, more work: a price above one of those is
        noise, such as a burst of load while it was timed, kept in the store for later studies)."""
        timed = {**self._width, self.verify_width: self._verify_rows(None)}
        out: dict[int, float] = {}
        cap = float("inf")
        for rows in sorted(timed, reverse=True):
            seen = self._seen_median(rows)
            cap = out[rows] = min(cap, timed[rows] * self.verify_scale if seen is None else seen)
        return out

    def _seen_median(self, rows: int) -> float | None:
        """The median of the latest verify rounds of ``rows`` rows seen, once ``SEEN_MIN`` were (unpadded)."""
        seen = None if self.padded else self._seen.get(rows)
        return statistics.median(seen) if seen and len(seen) >= SEEN_MIN else None

    def _verify_rows(self, rows: float | None) -> float:
        """Unscaled timings: the full-width verify, or (unpadded) a verify of ``rows`` rows: the
        timed forwards at the row counts either side of it, interpolated (what the scale relates
        decode rounds to)."""
        if self._verify is None:
            self._verify = self._forward_s(self.target, self.verify_width, None, best_of=VERIFY_TIMINGS,
                                           every_logit=True)
        if self.padded or rows is None or self.verify_width <= 1:
            return self._verify
        rows = min(max(rows, 1.0), float(self.verify_width))
        lo = int(rows)
        below = self._rows_s(lo)
        return below if rows == lo else below + (rows - lo) * (self._rows_s(lo + 1) - below)

    def _rows_s(self, rows: int) -> float:
        """An unpadded verify of exactly ``rows`` rows as timed: the plain step at 1 (capped by the
        full width's time), the timed full width at ``verify_width``, else one forward timed on
        first use."""
        if rows <= 1:  # unscaled, as the rest: the plain step's price is already on the decode's scale
            return min(self._plain_price() / self.verify_scale, self._verify_rows(None))
        if rows >= self.verify_width:
            return self._verify_rows(None)
        if rows not in self._width:
            self._width[rows] = self._forward_s(self.target, rows, None, every_logit=True)
            self._table = None
        return self._width[rows]

    @property
    def shape(self) -> str:
        """What kept timings were timed for besides the store key (model with its precision, draft,
        hardware): the verify width, whether verifies pad, the two models' linear backends, and the
        build of the ggml extension where either runs gguf (another build, other timings)."""
        shape = (f"width {self.verify_width} {'padded' if self.padded else 'rows'} "
                 f"draft {self.draft.backend} target {self.target.backend}")
        if "gguf" in (self.draft.backend, self.target.backend):
            from runtime.kernels import extension_key

            shape += f" kernels {extension_key()}"
        return shape

    def timings(self) -> dict[str, Any]:
        """What was timed and learnt, to keep (``autotune.store``: per model, draft, precision and
        hardware) and ``restore`` in a later study, so it starts scoring at its first window. Plans
        with layer-parallel groups are left out (timed on first use)."""
        return {"verify_width": self.verify_width, "padded": self.padded, "context": self.context,
                "linear": list(self._linear) if self._linear else None, "rows": list(self._rows) if self._rows else None,
                "verify": self._kept(self.verify_width, self._verify),
                "width": {str(k): self._kept(k, v) for k, v in self._width.items()}, "plain": self._plain,
                "full": self._full, "draft_scale": self.draft_scale, "verify_scale": self.verify_scale}

    def _kept(self, rows: int, timed: float | None) -> float | None:
        """A row count's timing to keep: the median of its rounds seen while decoding where there
        are enough (on the timings' scale), so the next study starts from what decoding measured."""
        seen = self._seen_median(rows)
        return timed if timed is None or seen is None else seen / self.verify_scale

    def restore(self, kept: dict[str, Any]) -> bool:
        """Take timings kept by ``timings`` when they were timed at this verify width and padding;
        -> whether they were taken (what is missing is timed on first use, as without them)."""
        if not isinstance(kept, dict) or kept.get("verify_width") != self.verify_width \
                or kept.get("padded") != self.padded:
            return False
        try:
            linear, rows = kept.get("linear"), kept.get("rows")
            self._linear = (float(linear[0]), float(linear[1]), float(linear[2])) if linear else None
            self._rows = (float(rows[0]), float(rows[1])) if rows else None
            self._verify = _seconds(kept.get("verify"))
            self._width = {int(k): float(v) for k, v in (kept.get("width") or {}).items() if _seconds(v)}
            self._plain, self._full = _seconds(kept.get("plain")), _seconds(kept.get("full"))
            self.draft_scale = _seconds(kept.get("draft_scale")) or 1.0
            self.verify_scale = _seconds(kept.get("verify_scale")) or 1.0
            self._table = None
        except (TypeError, ValueError, IndexError, AttributeError):
            return False
        return True

    def adopt_target(self, other: MeasuredCostModel) -> bool:
        """Take the target's timings ``other`` prepared (the plain step, the full verify, each row
        count) where it times the same target weights and backend at the same width, padding and
        context: a target forward costs the same whichever model drafts, so a server times its
        target once. Scales and what decoding refreshes stay this model's. -> whether taken."""
        if other is self or not other._target_timed or _target_key(other) != _target_key(self):
            return False
        self._plain, self._verify, self._width = other._plain, other._verify, dict(other._width)
        self._table, self._target_timed = None, True
        return True

    def prepare(self, fit_skips: bool = False) -> None:
        """Time now everything a controller's scoring may price: the plain step, the full verify,
        the draft step and its catch-up, and (unpadded) every verify row count. Otherwise a count
        is timed the first time it is priced, inside a request: on the 1.5B at int4 that made
        request control cost 2.1% of decode time over a replay (3.8% on XSum), against a 2% budget.
        Each row count is timed twice, in two passes over them all, and the faster kept: a burst of
        load on the machine seldom spans both. The plain step, timed first, is timed again last and the
        faster kept (the first forwards after a load run slow), unless decoded plain rounds price it.
        The target's part is done once: a second call, or one after ``adopt_target``, times only
        what is missing of the drafting model's."""
        self.plain_step_s(), self.verify_s(), self.draft_forward_s(None), self.catch_up_s(2.0)
        if fit_skips:  # plans that skip sub-layers are priced from the fit
            self._fit()
        if self._target_timed:
            return
        self._target_timed = True
        if not self.padded:
            for rows in range(2, self.verify_width):
                self._rows_s(rows)
            for rows in range(2, self.verify_width):
                again = self._forward_s(self.target, rows, None, every_logit=True)
                self._width[rows] = min(self._width[rows], again)
            self._table = None
        if not self._plain_seen:  # no decoded plain round has priced it yet
            self._plain = min(self._plain_price(), self._forward_s(self.target, 1, None, best_of=VERIFY_TIMINGS))

    def plain_step_s(self) -> float:
        """One single-token target forward: a round of plain decoding (the bar every strategy must
        beat). Before any plain round is seen, the faster of two timed forwards; never above the
        price of a verify of two rows (of the full width where verifies pad)."""
        if self.padded or self.verify_width <= 2:
            return min(self._plain_price(), self._verify_rows(None) * self.verify_scale)
        return min(self._plain_price(), self._price(2))

    def _plain_price(self) -> float:
        """The plain step timed, kept or seen (``observe_plain``), uncapped."""
        if self._plain is None:
            self._plain = self._forward_s(self.target, 1, None, best_of=VERIFY_TIMINGS)
        return self._plain

    def observe_draft(self, predicted_s: float, measured_s: float) -> None:
        """Refresh from a decoded round: its predicted vs measured draft time."""
        if predicted_s > 0 and measured_s > 0:
            self.draft_scale *= (1 - EMA) + EMA * measured_s / predicted_s

    def observe_plain(self, measured_s: float) -> None:
        """Refresh from a plain decoding round (the bar candidates must beat moves with the machine):
        the median of the latest ``PLAIN_OBSERVED`` seen, the timed or kept figure one vote among
        them until they push it out."""
        if measured_s > 0:
            if not self._plain_seen and self._plain is not None:
                self._plain_seen.append(self._plain)
            self._plain_seen.append(measured_s)
            self._plain = statistics.median(self._plain_seen)

    def observe_verify(self, measured_s: float, rows: float | None = None) -> None:
        """Refresh from a decoded round's verify time (its first one replaces the timed forward
        where verifies are padded; one of ``rows`` rows rescales the row model otherwise, and a
        round of a whole row count joins that count's latest seen, whose median then prices it)."""
        if measured_s <= 0:
            return
        if self._verify is None and (self.padded or rows is None):
            self._verify, self.verify_scale = measured_s, 1.0
        else:
            self.verify_scale = (1 - EMA) * self.verify_scale + EMA * measured_s / self._verify_rows(rows)
        if not self.padded and rows is not None and float(rows).is_integer() and 2 <= rows <= self.verify_width:
            self._seen.setdefault(int(rows), deque(maxlen=PLAIN_OBSERVED)).append(measured_s)
        self._table = None


def _target_key(cost: MeasuredCostModel) -> tuple:
    """What a cost model's target timings depend on besides the machine (not the drafting model)."""
    return (id(getattr(cost.target, "hf_model", cost.target)), cost.target.backend, cost.verify_width, cost.padded,
            cost.context)


def _seconds(value: Any) -> float | None:
    """A kept timing: a positive finite number of seconds, else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if 0.0 < value < float("inf") else None


@dataclass
class FixedCostModel:
    """Constant costs (tests, and what-if analyses)."""

    draft_full_s: float = 1.0
    verify_const_s: float = 3.0
    catch_up_row_s: float = 0.0  # each further row of an exact catch-up forward
    verify_row_s: float = 0.0  # each verify row past the first (a decoder that does not pad)

    def draft_forward_s(self, plan: LayerPlan | None) -> float:
        if plan is None:
            return self.draft_full_s
        return self.draft_full_s * (1.0 - plan.skip_ratio)

    def catch_up_s(self, rows: float) -> float:
        return self.draft_full_s + max(rows - 1.0, 0.0) * self.catch_up_row_s

    def verify_s(self, rows: float | None = None) -> float:
        return self.verify_const_s + (0.0 if rows is None else max(rows - 1.0, 0.0) * self.verify_row_s)

    def plain_step_s(self) -> float:
        return self.verify_const_s

    def observe_draft(self, predicted_s: float, measured_s: float) -> None:
        return None

    def observe_verify(self, measured_s: float, rows: float | None = None) -> None:
        return None

    def observe_plain(self, measured_s: float) -> None:
        return None
