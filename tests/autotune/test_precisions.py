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


@pytest.mark.slow
def test_a_target_loaded_from_its_blocks_times_float_precisions_only_where_their_tree_fits(pool, monkeypatch):
    """A gguf target has no float tree; the advice loads one for int8 / int4 / w8a8 only where it and
    its quantised copy fit in the memory available (an 8B model's would not in 24 GiB), and names why
    it did not."""
    target = pool.get("smollm2-135m", "gguf")
    floats = pool.get("smollm2-135m", "float32")
    size = precisions.float_tree_bytes(target)
    assert size == 4 * sum(p.numel() for p in floats.hf_model.parameters())
    candidates = ["int8", "int4", "w8a8", "gguf"]
    monkeypatch.setattr(precisions, "available_memory", lambda: 2 * size)
    assert precisions.untimed(target, candidates) == {}
    monkeypatch.setattr(precisions, "available_memory", lambda: size)
    left = precisions.untimed(target, candidates)
    assert set(left) == {"int8", "int4", "w8a8"} and "GiB is available" in left["int4"]
    assert precisions.untimed(pool.get("smollm2-135m", "int4"), candidates) == {}  # its float tree is loaded


def test_the_study_table_names_the_precisions_not_timed():
    from autotune.reports.study_table import _precision_text

    info = {"precision": "gguf", "fastest": "gguf", "fastest_plain": "gguf",
            "estimates": [{"precision": "gguf", "plain_tps": 10.0, "chosen_tps": 20.0, "current": True}],
            "not_timed": {"int4": "its float32 tree needs 40.0 GiB, 20.0 GiB is available", "w8a8": "same"}}
    assert "not timed: int4, w8a8 (its float32 tree needs 40.0 GiB" in _precision_text(info)
