"""The precision advice re-prices a study's measured rounds at each precision by the rows each
round verified (``DecodeStats.verify_rows``), not at the full verify width: a quantised verify's
cost grows with its rows, so a strategy whose rounds verify 2-3 rows is priced at 2-3 rows."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from autotune.tuning import precisions
from autotune.tuning.precisions import estimate, timed_rows
from runtime.stats import DecodeStats

# synthetic step costs (s) by rows: int4 rises in blocks of 4 rows, w8a8 is nearly flat
COST = {"int4": lambda r: 0.087 + 0.025 * (timed_rows(r) - 1), "w8a8": lambda r: 0.120 + 0.002 * (r - 1)}


def test_timed_rows_are_the_block_ends():
    assert [timed_rows(r) for r in (1, 2, 3, 4, 5, 8, 9, 13, 16, 17)] == [1, 2, 3, 4, 8, 8, 12, 16, 16, 20]


@pytest.fixture
def synthetic(monkeypatch):
    calls = []

    def seconds(self, precision, rows):
        calls.append((precision, rows))
        return COST[precision](min(rows, self.width))

    monkeypatch.setattr(precisions._Steps, "seconds", seconds)
    return calls


def _stats(rows_hist: list[int]) -> DecodeStats:
    rounds = sum(rows_hist)
    verify_s = sum(n * COST["int4"](r) for r, n in enumerate(rows_hist) if r)
    return DecodeStats(new_tokens=1 + 2 * rounds, draft_s=0.5, verify_s=verify_s, target_forwards=1 + rounds,
                       verify_rows=list(rows_hist))


def test_rounds_are_re_priced_by_the_rows_they_verified(synthetic):
    target = SimpleNamespace(name="m", precision="int4")
    stats = _stats([0, 10, 20, 30])  # 10 rounds of 1 row, 20 of 2, 30 of 3: short lookups
    got = {e.precision: e for e in estimate(SimpleNamespace(device="cpu"), target, stats, width=13, context=64,
                                            candidates=("int4", "w8a8"))}
    tokens = stats.new_tokens - 1
    assert got["int4"].current and got["int4"].chosen_tps == pytest.approx(tokens / (0.5 + stats.verify_s))
    w8a8_verify = sum(n * COST["w8a8"](r) for r, n in enumerate(stats.verify_rows) if r)
    assert got["w8a8"].chosen_tps == pytest.approx(tokens / (0.5 + w8a8_verify))
    assert got["w8a8"].plain_tps == pytest.approx(1 / COST["w8a8"](1))
    assert ("int4", 13) not in synthetic  # never timed at the full width: no round verified 13 rows
    # power: priced at the full width (the old rule), w8a8 comes out ~2.3x faster than the rows say
    old = tokens / (0.5 + stats.verify_s * COST["w8a8"](13) / COST["int4"](13))
    assert old > 1.3 * got["w8a8"].chosen_tps


def test_plain_decoding_scales_with_the_one_row_step(synthetic):
    target = SimpleNamespace(name="m", precision="int4")
    stats = DecodeStats(new_tokens=33, verify_s=32 * COST["int4"](1), target_forwards=33, verify_rows=[0, 32])
    got = {e.precision: e for e in estimate(SimpleNamespace(device="cpu"), target, stats, width=1, context=64,
                                            candidates=("int4", "w8a8"))}
    assert got["w8a8"].chosen_tps == pytest.approx(32 / (32 * COST["w8a8"](1)))
