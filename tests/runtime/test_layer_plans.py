"""Layer plans (EasySpec fuzzy groups, SWIFT skips) keep decoding lossless; only acceptance moves.
Under sampling, test_distribution.py checks plans and self-drafting against the exact distribution."""
from __future__ import annotations

import copy
import itertools

import pytest
import torch

from runtime.decoding import Decoder, GenerationConfig
from runtime.drafters import ModelDrafter, SelfDrafter, TreeShape
from runtime.testing import noisy_copy, tiny_model
from runtime.transformer import CausalLM
from search_spaces import LayerPlan, Strategy, easyspec_plan, uniform_skip_plan

PROMPT = [5, 17, 3, 88, 42, 7, 9, 61]
CFG = GenerationConfig(max_new_tokens=40)
SHAPES = [None, TreeShape((2, 2, 1)), TreeShape((1, 1, 1, 1), dynamic=((0.5, 3), (1.0, 1)))]


def model_decoder(target: CausalLM, draft: CausalLM, plan, calibrate=True, shape=None, k=4) -> Decoder:
    shape = shape or TreeShape((1,) * k)
    drafter = ModelDrafter(draft, target.dims.vocab, shape, plan=plan, calibrate=calibrate)
    return Decoder(target, drafter, len(shape.widths), verify_width=shape.max_nodes() + 1)


def self_decoder(target: CausalLM, plan, shape=None, k=4) -> Decoder:
    shape = shape or TreeShape((1,) * k)
    return Decoder(target, SelfDrafter(target, plan, shape), len(shape.widths), verify_width=shape.max_nodes() + 1)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("lp", [2, 3, 4])
@pytest.mark.parametrize("calibrate", [True, False])
@pytest.mark.parametrize("shape", SHAPES, ids=["chain", "tree", "dynamic"])
def test_easyspec_plans_are_lossless(family, lp, calibrate, shape):
    target_hf = tiny_model(family, 40, layers=8)
    target = CausalLM(target_hf)
    draft = CausalLM(noisy_copy(target_hf, 0.05, 1))
    plain = Decoder(target).generate(PROMPT, CFG).tokens
    out = model_decoder(target, draft, easyspec_plan(8, lp), calibrate, shape).generate(PROMPT, CFG)
    assert out.tokens == plain
    assert out.stats.drafted > 0


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("ratio", [0.25, 0.5])
@pytest.mark.parametrize("shape", SHAPES, ids=["chain", "tree", "dynamic"])
def test_self_speculation_is_lossless(family, ratio, shape):
    target = CausalLM(tiny_model(family, 41, layers=8))
    plain = Decoder(target).generate(PROMPT, CFG).tokens
    out = self_decoder(target, uniform_skip_plan(8, ratio), shape).generate(PROMPT, CFG)
    assert out.tokens == plain
    assert out.stats.drafted > 0


def test_self_speculation_with_attention_only_and_mlp_only_skips(tiny_llama):
    target = CausalLM(tiny_model("llama", 42, layers=6))
    plain = Decoder(target).generate(PROMPT, CFG).tokens
    for plan in (LayerPlan(6, skip_attn=(2, 3)), LayerPlan(6, skip_mlp=(1, 4)), LayerPlan(6, groups=((1, 2),), skip_mlp=(3,))):
        assert self_decoder(target, plan).generate(PROMPT, CFG).tokens == plain


def test_calibration_changes_acceptance_not_output():
    target_hf = tiny_model("qwen2", 43, layers=8)
    target = CausalLM(target_hf)
    draft = CausalLM(copy.deepcopy(target_hf))  # a perfect draft: only the fuzzy plan costs acceptance
    plan = easyspec_plan(8, 4)
    on = model_decoder(target, draft, plan, calibrate=True).generate(PROMPT, CFG)
    off = model_decoder(target, draft, plan, calibrate=False).generate(PROMPT, CFG)
    assert on.tokens == off.tokens == Decoder(target).generate(PROMPT, CFG).tokens
    assert on.stats.acceptance_rate != off.stats.acceptance_rate
    assert on.stats.acceptance_rate > off.stats.acceptance_rate


@pytest.mark.parametrize("calibrate", [True, False])
def test_identity_plan_drafts_on_the_plain_path(calibrate):
    """An identity plan is normalised away: the drafter runs the plain forward (no calibration
    catch-up, no plan executor). That the executor itself equals the plain forward on an identity
    plan is checked in tests/runtime/test_plan_execution.py."""
    target_hf = tiny_model("llama", 44, layers=5)
    draft = ModelDrafter(CausalLM(noisy_copy(target_hf, 0.1, 2)), 96, TreeShape((1,) * 4), plan=LayerPlan(5),
                         calibrate=calibrate)
    assert draft.plan is None and draft.calibrate is False
    draft.reconfigure(Strategy(draft_length=4, layer_plan=LayerPlan(5), calibrate=calibrate))
    assert draft.plan is None and draft.calibrate is False
    draft.reconfigure(Strategy(draft_length=4, layer_plan=LayerPlan(5, skip_mlp=(2,)), calibrate=calibrate))
    assert draft.plan == LayerPlan(5, skip_mlp=(2,)) and draft.calibrate is calibrate


def test_fuzzy_logits_exact_when_group_members_are_no_ops():
    """With every grouped layer's attention output zeroed, fuzzy == exact: a check of the group algebra."""
    hf = tiny_model("llama", 45, layers=6)
    with torch.no_grad():
        for li in range(1, 5):
            hf.model.layers[li].self_attn.o_proj.weight.zero_()
    lm = CausalLM(hf)
    ids = torch.tensor(PROMPT)
    with torch.inference_mode():
        exact = lm(ids, lm.new_cache(32))
        fuzzy = lm(ids, lm.new_cache(32), plan=easyspec_plan(6, 4))
    torch.testing.assert_close(fuzzy, exact)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_batched_group_equals_loop(family):
    lm = CausalLM(tiny_model(family, 46, layers=8))
    ids = torch.tensor(PROMPT)
    for plan in (easyspec_plan(8, 2), easyspec_plan(8, 4), LayerPlan(8, groups=((1, 4), (5, 6)), skip_attn=(2,))):
        outs = []
        for executor in ("batched", "loop"):
            lm.group_executor = executor
            cache = lm.new_cache(32)
            with torch.inference_mode():
                first = lm(ids, cache, plan=plan)
                step = lm(torch.tensor([3]), cache, plan=plan)
            outs.append((first, step))
        lm.group_executor = "batched"
        torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(outs[0][1], outs[1][1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(n_layers=8, groups=((3, 9),)), "groups"),
        (dict(n_layers=8, groups=((1, 3), (3, 5))), "groups"),
        (dict(n_layers=8, groups=((0, 2),)), "layer 0"),
        (dict(n_layers=8, skip_attn=(8,)), "skip_attn"),
        (dict(n_layers=8, skip_mlp=(-1,)), "skip_mlp"),
        (dict(n_layers=3, skip_attn=(0, 1, 2), skip_mlp=(0, 1, 2)), "every"),
        (dict(n_layers=8, groups=((2, 2),)), "groups"),
    ],
)
def test_invalid_plans_name_the_field(kwargs, field):
    from search_spaces import StrategyError

    with pytest.raises(StrategyError, match=field):
        LayerPlan(**kwargs)


def test_easyspec_default_plans_match_table_6():
    def text(plan):
        return ", ".join(f"{b[0]}-{b[-1]}" if len(b) > 1 else str(b[0]) for b in plan.blocks())

    assert text(easyspec_plan(32, 2)).startswith("0, 1-2, 3-4") and text(easyspec_plan(32, 2)).endswith("29-30, 31")
    assert text(easyspec_plan(32, 3)).startswith("0, 1-3, 4-6") and text(easyspec_plan(32, 3)).endswith("25-27, 28-30, 31")
    assert text(easyspec_plan(32, 4)).startswith("0, 1-3, 4-7, 8-11") and text(easyspec_plan(32, 4)).endswith("24-27, 28-30, 31")
    assert text(easyspec_plan(32, 5)).startswith("0, 1-3, 4-8, 9-13") and text(easyspec_plan(32, 5)).endswith("24-28, 29-30, 31")
    assert text(easyspec_plan(28, 4)).startswith("0, 1-3, 4-7, 8-11") and text(easyspec_plan(28, 4)).endswith("24-26, 27")


def test_uniform_skip_never_skips_first_or_last():
    for n, r in itertools.product((8, 24, 28, 30), (0.3, 0.45, 0.6)):
        plan = uniform_skip_plan(n, r)
        assert 0 not in plan.skip_attn and n - 1 not in plan.skip_attn
        assert len(plan.skip_attn) == round(r * n)


def test_plan_for_another_model_is_a_clear_error():
    from runtime.errors import RuntimeUserError

    lm = CausalLM(tiny_model("llama", 48, layers=4))
    with pytest.raises(RuntimeUserError, match="6 layers but the model has 4"):
        lm(torch.tensor([1, 2]), lm.new_cache(8), plan=LayerPlan(6, skip_attn=(2,)))
