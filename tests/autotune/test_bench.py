"""`autotune bench` end to end on the small real model (slow tier)."""
import json

import pytest

from autotune.cli.main import main

pytestmark = pytest.mark.slow


def test_bench_reports_every_method(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = main([
        "bench", "--model", "smollm2-135m", "--draft", "smollm2-135m", "--task", "humaneval", "--limit", "1",
        "--max-new-tokens", "12", "--methods", "hf,vanilla,sd,sd-tree,lookup", "--draft-length", "3", "--precision", "float32",
        "--json", str(out),
    ])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["baseline"] == "hf"
    assert set(report["methods"]) == {"hf", "vanilla", "sd", "sd-tree", "lookup"}
    for name, m in report["methods"].items():
        assert m["identical_to_baseline"], name
        assert m["new_tokens"] == 12
        for key in ("tokens_per_s", "wall_s", "acceptance_rate", "mean_accepted", "draft_ms_per_100",
                    "verify_ms_per_100", "speedup_vs_baseline", "mean_tree_size"):
            assert key in m
        if name != "hf":  # HF's generate does not time its prefill apart
            assert 0 < m["prefill_s"] < m["wall_s"], name
    assert report["methods"]["hf"]["prefill_s"] is None
    assert report["methods"]["sd-tree"]["mean_tree_size"] > report["methods"]["sd"]["mean_tree_size"]
    assert "identical" in capsys.readouterr().out


def test_bench_at_int4_checks_identity_against_our_plain_decoding(tmp_path, capsys):
    """Below float32 our methods must equal our plain decoding at that precision; HF's float32
    rows are compared by agreement instead."""
    out = tmp_path / "bench.json"
    code = main([
        "bench", "--model", "smollm2-135m", "--draft", "smollm2-135m", "--task", "humaneval", "--limit", "1",
        "--max-new-tokens", "16", "--methods", "hf,vanilla,sd,lookup", "--draft-length", "3", "--precision", "int4",
        "--draft-precision", "int8", "--json", str(out),
    ])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["precision"] == "int4" and report["identity_reference"] == "vanilla"
    methods = report["methods"]
    assert methods["hf"]["identical_to_baseline"] is None and 0 <= methods["hf"]["agreement"] <= 1
    for name in ("vanilla", "sd", "lookup"):
        assert methods[name]["identical_to_baseline"] is True and methods[name]["agreement"] == 1.0, name
    assert methods["sd"]["acceptance_rate"] is not None
    assert "bench at int4" in capsys.readouterr().out


def test_compiled_bench_warms_every_cache_bucket_without_a_shared_width():
    """``bench --compile`` warms one whole decode per cache-size bucket its methods meet; without
    ``--shared-width`` the widths are plain decoding's (1) and the widest method's. It used to add
    ``None`` (no shared width) to an int: every ``bench --compile`` without the flag failed."""
    from autotune.measure.bench import compile_prompts

    short, long_ = [1] * 100, [2] * 140  # 100 + 128 + 1 + 2 fits 256; 140 + 128 + 1 + 2 does not
    assert compile_prompts([short, long_], 128, (1,)) == [long_, short]
    # a width of 30 moves the short prompt into the second bucket: plain decoding still needs both
    assert compile_prompts([short, long_], 128, (1, 30)) == [long_, short]
    assert compile_prompts([short], 128, (1, 30)) == [short]
    assert compile_prompts([long_, long_], 128, (1, 11)) == [long_]
