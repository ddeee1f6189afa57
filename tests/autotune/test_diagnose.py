"""``autotune diagnose``: EasySpec table 5 (exact vs. fuzzy attention states) on tiny models."""
from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from autotune.measure.diagnose import STATES, StateRecorder, diagnose, format_table, fuzzy_layers, token_cosines
from runtime.errors import RuntimeUserError
from runtime.testing import tiny_model
from runtime.transformer import CausalLM
from search_spaces.layer_plan import easyspec_plan

LAYERS = 8


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def lm(request) -> CausalLM:
    return CausalLM(tiny_model(request.param, seed=7, layers=LAYERS))


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (9, 17)]


def test_table_values(lm):
    report = diagnose(lm, _prompts(lm.dims.vocab), [1, 2, 3, 4])
    assert report["tokens"] == 26 and report["n_layers"] == LAYERS
    lp1 = report["lp"][1]
    assert lp1["fuzzy_layers"] == []
    assert all(math.isnan(lp1["fuzzy"][s]) for s in STATES)
    assert all(lp1["all"][s] == 1.0 for s in STATES)  # the same computation both ways
    assert lp1["top1"] == 1.0
    # over the exact prefix K/V (another attention shape): equal up to rounding
    assert all(lp1["exact_prefix"]["all"][s] == pytest.approx(1.0, abs=1e-6) for s in STATES)
    assert lp1["exact_prefix"]["top1"] == 1.0
    for lp in (2, 3, 4):
        r = report["lp"][lp]
        assert r["fuzzy_layers"] == fuzzy_layers(easyspec_plan(LAYERS, lp))
        for res in (r, r["exact_prefix"]):
            for variant in ("fuzzy", "all"):
                for s in STATES:
                    assert -1.0 <= res[variant][s] <= 1.0
            assert 0.0 <= res["top1"] <= 1.0
        # the fuzzy members read the group input instead of their own: h differs
        assert r["fuzzy"]["h"] < 1.0
        # layer 0 runs alone and first in every plan: identical states
        assert all(v == 1.0 for v in r["per_layer"][0].values())
    text = format_table(report, title="tiny")
    assert "Attn output" in text and "0.93" in text  # ours beside EasySpec's published figures


def test_fuzzy_h_is_the_group_input(lm):
    """The fuzzy run's h of a group member is what its attention reads: the group's input."""
    ids = _prompts(lm.dims.vocab)[0]
    plan = easyspec_plan(LAYERS, 3)  # groups (1,3), (4,6)
    rec = StateRecorder()
    lm.recorder = rec
    try:
        with torch.inference_mode():
            lm(torch.tensor(ids), lm.new_cache(len(ids)), plan=plan)
    finally:
        lm.recorder = None
    for first, last in plan.groups:
        for li in range(first + 1, last + 1):
            assert torch.equal(rec.states[li]["h"], rec.states[first]["h"])
    assert not torch.equal(rec.states[4]["h"], rec.states[3]["h"])


def test_exact_prefix_run_is_a_fuzzy_step_over_the_exact_cache(lm):
    """The one-pass exact-prefix variant equals, per token, a fuzzy single-token forward after an
    exact prefill of the tokens before it."""
    from autotune.measure.diagnose import _run

    ids = _prompts(lm.dims.vocab)[1]
    plan = easyspec_plan(LAYERS, 3)
    cache = lm.new_cache(2 * len(ids))
    _run(lm, ids, None, StateRecorder(), cache)
    one_pass = StateRecorder()
    _run(lm, ids, plan, one_pass, cache, exact_prefix=True)
    for t in (0, 5, len(ids) - 1):
        step_cache = lm.new_cache(t + 1)
        with torch.inference_mode():
            if t:
                lm(torch.tensor(ids[:t]), step_cache)
        step = StateRecorder()
        lm.recorder = step
        try:
            with torch.inference_mode():
                lm(torch.tensor(ids[t : t + 1]), step_cache, plan=plan)
        finally:
            lm.recorder = None
        for li in range(LAYERS):
            for name in STATES:
                torch.testing.assert_close(one_pass.states[li][name][t : t + 1], step.states[li][name],
                                           rtol=1e-4, atol=1e-5)


def test_recorder_does_not_change_outputs(lm):
    ids = torch.tensor(_prompts(lm.dims.vocab)[1])
    with torch.inference_mode():
        for plan in (None, easyspec_plan(LAYERS, 2)):
            plain = lm(ids, lm.new_cache(len(ids)), plan=plan)
            lm.recorder = StateRecorder()
            try:
                recorded = lm(ids, lm.new_cache(len(ids)), plan=plan)
            finally:
                lm.recorder = None
            torch.testing.assert_close(recorded, plain, rtol=1e-5, atol=1e-5)


def test_token_cosines():
    a = torch.randn(5, 7)
    assert torch.equal(token_cosines(a, a), torch.ones(5, dtype=torch.float64))
    assert torch.allclose(token_cosines(a, -a), -torch.ones(5, dtype=torch.float64))
    z = torch.zeros(2, 7)
    assert token_cosines(z, z).tolist() == [1.0, 1.0]
    assert token_cosines(z, a[:2]).tolist() == [0.0, 0.0]


@pytest.mark.parametrize("lp_sizes,needle", [([9], "out of range"), ([0], "out of range"), ([], "at least one")])
def test_bad_lp_sizes(lm, lp_sizes, needle):
    with pytest.raises(RuntimeUserError, match=needle):
        diagnose(lm, _prompts(lm.dims.vocab), lp_sizes)


def test_too_shallow_and_empty_prompts():
    shallow = CausalLM(tiny_model("llama", seed=0, layers=3))
    with pytest.raises(RuntimeUserError, match="at least 4"):
        diagnose(shallow, [[1, 2, 3]], [2])
    with pytest.raises(RuntimeUserError, match="at least one prompt"):
        diagnose(shallow, [], [1])
    with pytest.raises(RuntimeUserError, match="empty"):
        diagnose(shallow, [[]], [1])


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autotune.cli", *args], capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize(
    "args,needles",
    [
        (["diagnose", "--model", "no-such-model", "--prompt", "hi"], ["unknown model 'no-such-model'"]),
        (["diagnose", "--model", "smollm2-135m", "--prompt", "hi", "--lp-size", "1,2"], ["--lp-size", "at least 2"]),
        (["diagnose", "--model", "smollm2-135m", "--prompt", "hi", "--lp-size", "two"], ["--lp-size"]),
        (["diagnose", "--model", "smollm2-135m"], ["--prompt", "--task"]),
        (["diagnose", "--model", "smollm2-135m", "--task", "gsm9k"], ["unknown task"]),
    ],
)
def test_cli_errors(args, needles):
    proc = _cli(*args)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.slow
def test_cli_lp_size_beyond_layers():
    proc = _cli("diagnose", "--model", "smollm2-135m", "--prompt", "hi", "--lp-size", "31")
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "out of range" in lines[0] and "30 layers" in lines[0], lines[0]
