"""Layer-plan execution: an identity plan through the plan executor is the plain forward, and the
compiled-plan cache (stacked group weights) stays bounded however many plans a tuner scores."""
from __future__ import annotations

import itertools

import torch

from runtime.attention import attend_mask
from runtime.layer_exec import AttnInputs, run_blocks
from runtime.testing import tiny_model
from runtime.transformer import MAX_COMPILED_PLANS, CausalLM
from search_spaces import LayerPlan

PROMPT = [5, 17, 3, 88, 42, 7, 9, 61]


def _through_executor(lm: CausalLM, plan: LayerPlan, ids: list[int], cache) -> torch.Tensor:
    """``lm.forward`` with the layer loop replaced by the plan executor (``run_blocks``)."""
    t = len(ids)
    slots = cache.slots(t)
    lm.rope.ensure(cache.capacity + 1, lm.device)
    cos, sin = lm.rope.lookup(slots)
    prefill = cache.length == 0 and t > 1
    mask = None if prefill else attend_mask(slots, cache.capacity, None)
    h = lm.embed(torch.tensor(ids))
    a = AttnInputs(cache, cos, sin, mask, prefill, None, slots, t if prefill else None)
    h = run_blocks(lm, lm.compiled(plan), h, a, lm.group_executor)
    cache.advance(t)
    return lm.head(lm.norm(h))


def test_identity_plan_through_the_executor_equals_the_plain_forward():
    """The executor's per-block path (what every grouped or skipping plan runs) gives the plain
    layer loop's logits and K/V when nothing is grouped or skipped: prefill, then one step."""
    lm = CausalLM(tiny_model("qwen2", 44, layers=5))
    plain_cache, plan_cache = lm.new_cache(32), lm.new_cache(32)
    with torch.inference_mode():
        plain = [lm(torch.tensor(PROMPT), plain_cache), lm(torch.tensor([3]), plain_cache)]
        ident = [_through_executor(lm, LayerPlan(5), PROMPT, plan_cache), _through_executor(lm, LayerPlan(5), [3], plan_cache)]
    for a, b in zip(plain, ident):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert plan_cache.length == plain_cache.length == len(PROMPT) + 1
    for li in range(5):
        torch.testing.assert_close(plan_cache.view(li)[0], plain_cache.view(li)[0], rtol=1e-5, atol=1e-5)
    # and a non-identity plan really takes another path (the comparison above can fail)
    with torch.inference_mode():
        fuzzy = _through_executor(lm, LayerPlan(5, groups=((1, 3),)), PROMPT, lm.new_cache(32))
    assert not torch.allclose(fuzzy, plain[0], rtol=1e-3, atol=1e-3)


def _stacked_bytes(lm: CausalLM) -> int:
    total = 0
    for compiled in lm._plans.values():
        for block in compiled.blocks:
            if block.group is not None:
                for t in (block.group.w_qkv, block.group.w_o, block.group.norm_w):
                    total += t.numel() * t.element_size()
    return total


def test_compiled_plans_are_bounded_and_recompiled_after_eviction():
    lm = CausalLM(tiny_model("llama", 45, layers=8))
    plans = [LayerPlan(8, groups=((a, b),)) for a, b in itertools.combinations(range(1, 7), 2)]
    assert len(plans) > MAX_COMPILED_PLANS + 4
    ids = torch.tensor(PROMPT)
    with torch.inference_mode():
        first = lm(ids, lm.new_cache(16), plan=plans[0])
        largest = 0
        for plan in plans:
            lm(ids, lm.new_cache(16), plan=plan)
            largest = max(largest, sum(b.group.w_qkv.numel() + b.group.w_o.numel() + b.group.norm_w.numel()
                                       for b in lm.compiled(plan).blocks if b.group is not None) * 4)
            assert len(lm._plans) <= MAX_COMPILED_PLANS
        assert 0 < _stacked_bytes(lm) <= MAX_COMPILED_PLANS * largest
        assert plans[0] not in lm._plans  # evicted ...
        again = lm(ids, lm.new_cache(16), plan=plans[0])  # ... and compiled afresh, same result
    torch.testing.assert_close(again, first, rtol=0, atol=0)


def test_recently_used_plan_survives_eviction():
    lm = CausalLM(tiny_model("llama", 46, layers=8))
    keep = LayerPlan(8, groups=((1, 2),))
    others = [LayerPlan(8, groups=((a, b),)) for a, b in itertools.combinations(range(2, 7), 2)]
    with torch.inference_mode():
        for plan in others:
            lm.compiled(keep)  # the incumbent is used between candidates
            lm.compiled(plan)
    assert keep in lm._plans
