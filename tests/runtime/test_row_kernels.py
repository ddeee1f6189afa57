"""The extension's row kernels beside the GGUF blocks (``runtime.kernels``): attention one row at a time
(``runtime.attention.attend_rows``), RMSNorm and RoPE.

Attention: it computes what SDPA computes (causal, tree and sliding-window masks, grouped-query
heads); every row is bit-identical whatever else shares its call, whatever the cache's capacity and
whatever the masked slots hold; a row that sees no slot gets zeros. The invariance check has power:
a rule that runs several rows another way (SDPA) fails it.
RMSNorm: Hugging Face's formula, row-invariant. RoPE: bit-identical to ``apply_rope``."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime import kernels
from runtime.attention import apply_rope, attend_rows

H, HKV, D = 6, 2, 64


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _cache(capacity: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(seed)
    return torch.randn(HKV, capacity, D, generator=g), torch.randn(HKV, capacity, D, generator=g)


def _causal(start: int, t: int, capacity: int) -> torch.Tensor:
    return torch.arange(capacity)[None, :] <= (start + torch.arange(t))[:, None]


def _sdpa(q, k, v, mask, scale):
    rep = q.shape[0] // k.shape[0]
    return F.scaled_dot_product_attention(
        q[None], k.repeat_interleave(rep, 0)[None], v.repeat_interleave(rep, 0)[None],
        attn_mask=mask[None, None], scale=scale)[0]


def call_dependent(q, k, v, mask, scale):
    """A deliberately wrong rule: a lone row attends by the row kernel, a call of several rows by SDPA
    over the cache's whole capacity (another summation order)."""
    return attend_rows(q, k, v, mask, scale) if q.shape[1] == 1 else _sdpa(q, k, v, mask, scale)


def rows_invariant(attend, t: int = 9, start: int = 40) -> bool:
    """Each of ``t`` contiguous rows equals that row computed alone, bit for bit, and stays so when the
    cache is larger and its unseen slots hold other values."""
    q = torch.randn(H, t, D, generator=_gen(3))
    k, v = _cache(start + t + 7)
    scale = D ** -0.5
    together = attend(q, k, v, _causal(start, t, k.shape[1]), scale)
    k2, v2 = _cache(4 * (start + t), seed=9)
    k2[:, : start + t], v2[:, : start + t] = k[:, : start + t], v[:, : start + t]
    for r in range(t):
        alone = attend(q[:, r : r + 1], k2, v2, _causal(start + r, 1, k2.shape[1]), scale)
        if not torch.equal(alone, together[:, r : r + 1]):
            return False
    return True


@pytest.fixture(scope="module", autouse=True)
def _built():
    if not kernels.available():
        pytest.skip("ggml kernels not built (make kernels)")


def test_row_attention_computes_what_sdpa_computes():
    capacity, start, t = 96, 30, 12
    q = torch.randn(H, t, D, generator=_gen(1))
    k, v = _cache(capacity)
    causal = _causal(start, t, capacity)
    tree = causal.clone()
    tree[5, start + 2 : start + 5] = False  # a tree row that does not see three earlier rows of its round
    window = causal & (torch.arange(capacity)[None, :] > (start + torch.arange(t))[:, None] - 16)
    for mask in (causal, tree, window):
        got = attend_rows(q, k, v, mask, D ** -0.5)
        assert torch.allclose(got, _sdpa(q, k, v, mask, D ** -0.5), atol=1e-5, rtol=1e-4)


def test_a_row_that_sees_nothing_gets_zeros():
    k, v = _cache(16)
    mask = torch.zeros(2, 16, dtype=torch.bool)
    mask[1, :4] = True
    out = attend_rows(torch.randn(H, 2, D, generator=_gen(2)), k, v, mask, 0.125)
    assert torch.equal(out[:, 0], torch.zeros(H, D)) and out[:, 1].abs().sum() > 0


def test_row_attention_is_row_invariant_and_the_check_has_power():
    assert rows_invariant(attend_rows)
    assert not rows_invariant(call_dependent)


def test_a_tree_row_equals_the_plain_step_at_its_position():
    """A tree row whose ancestors sit after the committed prefix sees the same keys, in the same
    order, as a plain step at its position over a cache holding that path: the same bits."""
    prefix, capacity = 20, 64
    k, v = _cache(capacity)
    q = torch.randn(H, 1, D, generator=_gen(4))
    # the tree's round: slots 20..23, the row at slot 23 descends from 20 and 22 (not 21)
    mask = torch.zeros(1, capacity, dtype=torch.bool)
    mask[0, :prefix] = True
    mask[0, [20, 22, 23]] = True
    tree_row = attend_rows(q, k, v, mask, D ** -0.5)
    path = torch.tensor(list(range(prefix)) + [20, 22, 23])
    kp, vp = k[:, path].contiguous(), v[:, path].contiguous()
    plain = attend_rows(q, kp, vp, _causal(prefix + 2, 1, path.numel()), D ** -0.5)
    assert torch.equal(tree_row, plain)


def test_rms_norm_is_the_models_formula_and_row_invariant():
    x = torch.randn(7, 96, generator=_gen(5)) * torch.logspace(-2, 2, 7)[:, None]
    w = torch.randn(96, generator=_gen(6))
    ops = kernels.load()
    got = ops.rms_norm(x, w, 1e-6)
    want = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(ops.rms_norm(x[i : i + 1], w, 1e-6), got[i : i + 1]) for i in range(7))


def test_rope_is_apply_rope_bit_for_bit():
    x = torch.randn(H, 5, D, generator=_gen(7))
    angles = torch.randn(5, D // 2, generator=_gen(8))
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    assert torch.equal(kernels.load().rope(x, cos, sin), apply_rope(x, cos, sin))


@pytest.mark.parametrize("family", ["qwen2", "llama"])  # q/k/v biases, and none
def test_a_whole_layer_call_is_the_layer_loop_bit_for_bit(family):
    """``kernels.layer`` (one call per layer, ``CausalLM.fused_layers``) computes a prompt, a plain
    step and a verify's rows exactly as the per-op layer loop does, and writes the same K/V."""
    from runtime.layout import Layout
    from runtime.testing import tiny_model
    from runtime.transformer import CausalLM

    model = tiny_model(family, 5, layers=3)
    fused, loop = CausalLM(model), CausalLM(model)
    for lm in (fused, loop):
        lm.use_linear_backend("gguf")
    loop._fused = []  # no layer runs as one call: the per-op loop
    assert fused.fused_layers() is not None and loop.fused_layers() is None
    caches = [lm.new_cache(64) for lm in (fused, loop)]
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # two children of one root
    for tokens in ([3, 14, 15, 9, 2, 6], [5], [7, 8, 9, 1], [4, 2, 6]):
        t = torch.tensor(tokens)
        layout = Layout()
        if len(tokens) == 3:  # a tree's rows, at depths 0, 1, 1
            start = caches[0].length
            layout = Layout.block(tree, torch.tensor([start, start + 1, start + 1]))
        a, b = (lm.forward(t, c, layout) for lm, c in zip((fused, loop), caches))
        assert torch.equal(a, b)
    assert torch.equal(caches[0].all_keys, caches[1].all_keys) and torch.equal(caches[0].all_values, caches[1].all_values)
