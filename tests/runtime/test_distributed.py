"""Layer-parallel group executors: ``batched`` equals the ``loop`` reference; ``distributed``
(one member per rank, torchrun with 2 gloo processes) drafts what ``batched`` drafts in one process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import runtime.distributed  # noqa: F401  (registers the 'distributed' group executor)
from runtime.distributed_check import build_lm, greedy_draft, prompt_tokens
from runtime.errors import RuntimeUserError
from runtime.layer_exec import GROUP_EXECUTORS
from runtime.layout import Layout
from runtime.testing import tiny_model
from runtime.transformer import CausalLM
from search_spaces.layer_plan import LayerPlan, easyspec_plan

REPO = Path(__file__).resolve().parents[2]
LAYERS = 8

PLANS = {
    "easyspec-lp2": easyspec_plan(LAYERS, 2),
    "easyspec-lp3": easyspec_plan(LAYERS, 3),
    "easyspec-lp4": easyspec_plan(LAYERS, 4),
    # group (1,3) runs attention of 1 and 3 only: members not contiguous in the cache
    "skip-inside-group": LayerPlan(LAYERS, groups=((1, 3), (4, 6)), skip_attn=(2,)),
    # a one-member group, a group whose first attention is skipped, a skipped MLP
    "skip-first-member": LayerPlan(LAYERS, groups=((1, 2), (4, 6)), skip_attn=(1, 4), skip_mlp=(3,)),
    # a group with every attention skipped, and a group that ends at the last layer
    "all-skipped-group": LayerPlan(LAYERS, groups=((2, 3), (5, 7)), skip_attn=(2, 3)),
    "layer0-in-group": LayerPlan(LAYERS, groups=((0, 3),), allow_layer0_in_group=True),
}


def _forwards(lm: CausalLM, plan: LayerPlan) -> tuple[list[torch.Tensor], object]:
    """Prefill in two chunks, one single-token step, one tree step (explicit mask), one more step."""
    torch.manual_seed(5)
    v = lm.dims.vocab
    cache = lm.new_cache(32)
    outs = []
    with torch.inference_mode():
        outs.append(lm(torch.randint(0, v, (6,)), cache, plan=plan))  # causal, start 0
        outs.append(lm(torch.randint(0, v, (4,)), cache, plan=plan))  # causal mask over a prefix
        outs.append(lm(torch.randint(0, v, (1,)), cache, plan=plan))  # one token, no mask
        start = cache.length
        # tree: nodes 0 and 1 are siblings at depth 1, node 2 is node 0's child
        mask = torch.zeros(3, start + 3, dtype=torch.bool)
        mask[:, :start] = True
        mask[0, start] = mask[1, start + 1] = True
        mask[2, start] = mask[2, start + 2] = True
        positions = torch.tensor([start, start, start + 1])
        outs.append(lm(torch.randint(0, v, (3,)), cache, Layout.explicit(mask, positions), plan=plan))
        cache.commit(start, [0, 2])
        outs.append(lm(torch.randint(0, v, (1,)), cache, plan=plan))
    return outs, cache


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny8(request) -> torch.nn.Module:
    return tiny_model(request.param, seed=3, layers=LAYERS)


@pytest.mark.parametrize("name", list(PLANS))
def test_batched_equals_loop(tiny8, name):
    plan = PLANS[name]
    results = {}
    for executor in ("loop", "batched"):
        lm = CausalLM(tiny8)
        lm.group_executor = executor
        results[executor] = _forwards(lm, plan)
    (loop_out, loop_cache), (bat_out, bat_cache) = results["loop"], results["batched"]
    for i, (a, b) in enumerate(zip(loop_out, bat_out)):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4, msg=lambda m: f"forward {i}: {m}")
    n = loop_cache.length
    torch.testing.assert_close(bat_cache.all_keys[:, :, :n], loop_cache.all_keys[:, :, :n], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bat_cache.all_values[:, :, :n], loop_cache.all_values[:, :, :n], rtol=1e-5, atol=1e-5)


def test_fuzzy_plan_changes_the_output(tiny8):
    """Guard against a vacuous comparison: the fuzzy plans do differ from the exact model."""
    exact, _ = _forwards(CausalLM(tiny8), LayerPlan(LAYERS))
    fuzzy, _ = _forwards(CausalLM(tiny8), PLANS["easyspec-lp3"])
    assert not torch.allclose(exact[0], fuzzy[0], atol=1e-3)


def test_distributed_needs_process_group(tiny8):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    lm = CausalLM(tiny8)
    lm.group_executor = "distributed"
    assert "distributed" in GROUP_EXECUTORS
    with pytest.raises(RuntimeUserError, match="torchrun"):
        _forwards(lm, PLANS["easyspec-lp2"])


def test_distributed_single_process_equals_batched(tiny8):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        lm = CausalLM(tiny8)
        lm.group_executor = "distributed"
        dist_out, _ = _forwards(lm, PLANS["skip-inside-group"])
    finally:
        dist.destroy_process_group()
    bat_out, _ = _forwards(CausalLM(tiny8), PLANS["skip-inside-group"])
    for a, b in zip(dist_out, bat_out):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # ~15-25 s: three Python processes importing torch + transformers
def test_torchrun_two_ranks_match_batched(tmp_path):
    out = tmp_path / "draft.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "runtime.distributed_check", "--out", str(out), "--layers", str(LAYERS), "--lp-sizes", "2,3",
         "--n-new", "8"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    written = "report written" if out.exists() else "no report written"
    assert proc.returncode == 0, f"{written}\n" + proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["world_size"] == 2
    assert report["backend"] == "gloo"
    lm = build_lm(report["family"], report["seed"], report["layers"])
    prompt = prompt_tokens(report["seed"], len(report["prompt"]), lm.dims.vocab)
    assert prompt == report["prompt"]
    assert set(report["plans"]) == {"2", "3"}
    for lp, got in report["plans"].items():
        plan = easyspec_plan(LAYERS, int(lp))
        assert got["plan"] == plan.to_dict()
        assert got["max_rank_diff"] == 0.0  # replicated compute: every rank has the same logits
        ref = greedy_draft(lm, prompt, report["n_new"], plan)  # batched executor, one process
        assert got["tokens"] == ref["tokens"], f"lp {lp}"
        torch.testing.assert_close(torch.tensor(got["logits"]), ref["logits"], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(torch.tensor(got["tree_logits"]), ref["tree_logits"], rtol=1e-4, atol=1e-4)
