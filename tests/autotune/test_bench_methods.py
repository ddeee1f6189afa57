"""Bench method options (no model loads): draft length / tree shape per method, another store."""
from __future__ import annotations

import pytest

from autotune.errors import MethodError
from autotune.measure.methods import BenchContext, _lookup_strategy, _sd_strategy, _tree_strategy, parse_method
from search_spaces.strategy import DEFAULT_TREE_WIDTHS, Strategy


def ctx_for(spec: str) -> BenchContext:
    method = parse_method(spec)
    return BenchContext(pool=None, target=None, draft_name="d", dtype="float32", strategy=Strategy(draft_length=10),
                        lp_size=4, skip_ratio=0.45, options=dict(method.options))


def test_length_and_tree_options_shape_each_method():
    assert _sd_strategy(ctx_for("sd")) == Strategy(draft_length=10)
    assert _sd_strategy(ctx_for("sd:k4")) == Strategy(draft_length=4)
    assert _tree_strategy(ctx_for("sd-tree")).tree_widths == DEFAULT_TREE_WIDTHS
    tree = _tree_strategy(ctx_for("sd-tree:t2-1-1-1"))
    assert tree.tree_widths == (2, 1, 1, 1) and tree.draft_length == 4 and tree.max_tree_nodes == 8
    assert _tree_strategy(ctx_for("sd-tree:k3")).tree_widths == DEFAULT_TREE_WIDTHS[:3]
    assert _lookup_strategy(ctx_for("lookup:k6")) == Strategy(drafter="prompt-lookup", draft_length=6)


@pytest.mark.parametrize("spec", ["sd:k0", "sd:kx", "sd-tree:t2-0", "tuned:db=/no/such/file.db"])
def test_bad_options_are_one_clear_error(spec):
    with pytest.raises(MethodError, match="bad option"):
        parse_method(spec)


def test_lookup_option_is_for_draft_model_methods_only():
    assert _sd_strategy(ctx_for("sd:lookup")).lookup_first
    assert _tree_strategy(ctx_for("sd-tree:t2-1-1-1:lookup")).lookup_first
    assert not _sd_strategy(ctx_for("sd")).lookup_first
    for spec in ("lookup:lookup", "selfspec:lookup", "tuned:lookup", "vanilla:lookup"):
        with pytest.raises(MethodError, match="only the draft-model methods"):
            parse_method(spec)
    with pytest.raises(MethodError, match="bad option"):
        parse_method("sd:lookup2")


def test_db_option_reads_an_existing_store(tmp_path):
    db = tmp_path / "a.db"
    db.write_bytes(b"")
    assert dict(parse_method(f"tuned:db={db}").options) == {"db": str(db)}
