"""`autotune profile` (step costs without weights), packaged configs, and bench method hf-static."""
from __future__ import annotations

import json
import math

import pytest
import torch

from autotune.cli.main import main
from runtime.linear import float32_cpu_backend
from runtime.loading import model_config, packaged_configs, parse_dtype, random_model
from runtime.models import MODEL_ALIASES, PackagedGGUF
from tests.helpers import assert_one_line_error, run_cli


def _no_weights(*args, **kwargs):
    raise AssertionError("--random-weights must not touch model weights")


def test_profile_random_weights_writes_every_step(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path / "cache"))  # no cached weights either
    monkeypatch.setattr("runtime.loading._package_dir", _no_weights)
    monkeypatch.setattr("runtime.pipeline.load_model", _no_weights)
    out = tmp_path / "profile.json"
    code = main([
        "profile", "--model", "smollm2-135m", "--random-weights", "--widths", "1,4", "--lp-size", "2",
        "--min-time", "0.05", "--json", str(out),
    ])
    assert code == 0
    report = json.loads(out.read_text())
    cfg = report["config"]
    assert cfg["random_weights"] and cfg["precision"] == "int4" and cfg["device"] == "cpu"  # auto on CPU: int4
    assert cfg["widths"] == [1, 4] and cfg["lp_sizes"] == [2] and cfg["context"] == 256
    steps = [report["plain"], *report["verify"], *report["draft"]]
    for step in steps:
        assert step["ms"] > 0 and math.isfinite(step["ms"]) and step["runs"] >= 3, step
    assert [v["rows"] for v in report["verify"]] == [1, 4]
    assert [d["plan"] for d in report["draft"]] == ["none", "lp2"]
    none, lp2 = report["draft"]
    assert none["groups"] == [] and lp2["groups"] and all(last > first for first, last in lp2["groups"])
    for d in report["draft"]:
        assert d["c"] == pytest.approx(d["ms"] / report["plain"]["ms"])
    table = capsys.readouterr().out
    assert "profile" in table and "lp2" in table and "(c)" in table
    assert not (tmp_path / "cache").exists()


def test_profile_with_a_draft_times_the_draft(monkeypatch):
    from autotune.measure.profile import ProfileSettings, run_profile

    monkeypatch.setattr("runtime.pipeline.load_model", _no_weights)
    settings = ProfileSettings(widths=(2,), lp_sizes=(3,), context=16, min_run_time=0.01)
    report = run_profile("smollm2-135m", "smollm2-135m", "cpu", "float32", True, settings)
    assert report["config"]["draft"] == "smollm2-135m@random:0"
    assert [(d["kind"], d["plan"], d["model"]) for d in report["draft"]] == [
        ("draft", "none", "smollm2-135m"), ("draft", "lp3", "smollm2-135m")]
    assert all(d["c"] > 0 for d in report["draft"])


@pytest.mark.parametrize(
    "args,needles",
    [
        (["profile", "--model", "llama3-8b", "--random-weights"],
         ["no packaged config for model alias 'llama3-8b'", "smollm2-135m", "meta-llama/Meta-Llama-3-8B-Instruct"]),
        (["profile", "--model", "smollm2-135m", "--random-weights", "--widths", "1,x"], ["--widths", "'1,x'"]),
        (["profile", "--model", "smollm2-135m", "--random-weights", "--widths", "0,4"], ["--widths", "positive"]),
        (["profile", "--model", "smollm2-135m", "--random-weights", "--lp-size", "1"], ["--lp-size", "at least 2"]),
    ],
)
def test_profile_bad_input_is_one_line(args, needles):
    proc = run_cli(*args)
    assert_one_line_error(proc.returncode, proc.stderr, *needles, progress_bars=True)


def test_bench_random_weights_runs_synthetic_prompts_without_weights(tmp_path, monkeypatch):
    """``bench --random-weights``: models from configs, seeded random prompts, no EOS; every method
    decodes the whole budget and our methods still agree with HF token for token (fp32 CPU)."""
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr("runtime.loading._package_dir", _no_weights)
    monkeypatch.setattr("runtime.pipeline.load_model", _no_weights)
    out = tmp_path / "bench.json"
    code = main([
        "bench", "--model", "smollm2-135m", "--draft", "smollm2-135m", "--draft-precision", "float32",
        "--random-weights", "--limit", "1", "--prompt-len", "8", "--max-new-tokens", "6", "--precision", "float32",
        "--methods", "hf,vanilla,sd", "--draft-length", "3", "--confidence-threshold", "0", "--json", str(out),
    ])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["config"]["random_weights"] and report["config"]["model"] == "smollm2-135m@random:0"
    for name, m in report["methods"].items():
        assert m["new_tokens"] == 6 and m["identical_to_baseline"], name
    assert report["methods"]["sd"]["mean_tree_size"] > 0  # speculation happened
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize(
    "args,needles",
    [
        (["bench", "--model", "smollm2-135m", "--random-weights", "--task", "gsm8k"], ["--random-weights", "drop --task"]),
        (["bench", "--model", "smollm2-135m"], ["bench needs --task"]),
        (["bench", "--model", "smollm2-135m", "--random-weights", "--prompt-len", "0"], ["--prompt-len", "at least 1"]),
    ],
)
def test_bench_task_or_random_weights_is_one_line(args, needles):
    proc = run_cli(*args)
    assert_one_line_error(proc.returncode, proc.stderr, *needles, progress_bars=True)


def test_every_packaged_alias_ships_its_config():
    packaged = {name for name, src in MODEL_ALIASES.items() if isinstance(src, PackagedGGUF)}
    assert packaged <= set(packaged_configs())
    assert model_config("qwen2.5-coder-1.5b").num_hidden_layers == 28
    assert model_config("qwen2.5-coder-0.5b").num_hidden_layers == 24


def test_random_model_has_the_packaged_shape():
    model = random_model("smollm2-135m", "float32", "cpu", seed=3)
    cfg = model_config("smollm2-135m")
    hf = model.hf_model
    assert model.tokenizer is None and model.dtype == torch.float32
    assert len(hf.model.layers) == cfg.num_hidden_layers == 30
    assert hf.lm_head.weight.shape == (cfg.vocab_size, cfg.hidden_size) == (49152, 576)
    again = random_model("smollm2-135m", "float32", "cpu", seed=3)  # seeded: the same weights
    assert torch.equal(hf.model.layers[5].mlp.up_proj.weight, again.hf_model.model.layers[5].mlp.up_proj.weight)


def test_auto_dtype_depends_on_the_device():
    assert parse_dtype("auto", "cpu") == torch.float32
    assert parse_dtype("auto", "cuda:0") == torch.bfloat16
    assert parse_dtype("bf16") == torch.bfloat16
    with pytest.raises(Exception, match="depends on the device"):
        parse_dtype("auto")


@pytest.mark.slow
def test_hf_static_is_identical_to_hf(tmp_path):
    out = tmp_path / "bench.json"
    code = main([
        "bench", "--model", "smollm2-135m", "--task", "humaneval", "--limit", "1", "--max-new-tokens", "16",
        "--methods", "hf,hf-static", "--json", str(out),
    ])
    assert code == 0
    methods = json.loads(out.read_text())["methods"]
    assert methods["hf-static"]["identical_to_baseline"]
    assert methods["hf-static"]["new_tokens"] == 16


def test_cost_model_timing_waits_for_cuda_kernels(monkeypatch):
    """On CUDA a forward returns at launch: the cost model's clock reads sit between synchronisations."""
    from autotune.timing import time_calls

    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("sync"))
    time_calls(lambda: calls.append("step"), repeats=2, device=torch.device("cuda", 0))
    assert calls == ["step"] + ["sync", "step", "sync"] * 2  # warm-up, then each timed step fenced
    calls.clear()
    time_calls(lambda: calls.append("step"), repeats=2, device=torch.device("cpu"))
    assert calls == ["step"] * 3


def test_profile_compares_precisions_by_rows(tmp_path, capsys, monkeypatch):
    """``--precision a,b``: one report per precision (one module tree: float32 and w8a8 both load
    float32 weights), and a table of the target step by rows at each."""
    monkeypatch.setattr("runtime.pipeline.load_model", _no_weights)
    out = tmp_path / "profile.json"
    code = main([
        "profile", "--model", "smollm2-135m", "--random-weights", "--widths", "1,4", "--lp-size", "2",
        "--min-time", "0.02", "--precision", "float32,w8a8", "--json", str(out),
    ])
    assert code == 0
    reports = json.loads(out.read_text())["precisions"]
    assert [r["config"]["precision"] for r in reports] == ["float32", "w8a8"]
    assert {v["backend"] for v in reports[1]["verify"]} == {"w8a8"}
    # float32 verifies on what the pool serves: oneDNN's kernels (every width), else MKL's packed copy
    float32 = {v["backend"] for v in reports[0]["verify"]}
    if float32_cpu_backend() == "onednn":
        assert float32 == {"onednn"}
    else:
        assert "mkl-packed" in float32 or not torch.backends.mkl.is_available()
    assert "target step by rows" in capsys.readouterr().out


def test_profile_refuses_an_unknown_precision(capsys):
    code = main(["profile", "--model", "smollm2-135m", "--random-weights", "--precision", "int3"])
    assert code == 2
    assert "unknown precision 'int3'" in capsys.readouterr().err
