"""Quantised precisions (int8, int4, w8a8): row-invariant kernels, hence speculative greedy output
identical to plain greedy output at the same precision, on tiny models and on SmolLM2."""
from __future__ import annotations

import pytest
import torch

from runtime.decoding import Decoder, GenerationConfig
from runtime.drafters import ModelDrafter, SelfDrafter, TreeShape
from runtime.errors import RuntimeUserError
from runtime.linear import make_linear
from runtime.lookup import PromptLookupDrafter
from runtime.pipeline import ModelPool, build_decoder, eos_ids
from runtime.precision import PRECISIONS, get_precision
from runtime.quant import Int4WeightOnlyLinear, int4_linear, quantise_int4
from runtime.testing import noisy_copy, tiny_model
from runtime.transformer import CausalLM
from search_spaces import PLAIN, Strategy, easyspec_plan, uniform_skip_plan
from search_spaces.layer_plan import LayerPlan

QUANTISED = [name for name, p in PRECISIONS.items() if p.quantised]
ROW_INVARIANT = ["int8", "int4", "w8a8"]


def rows_invariant(linear, x: torch.Tensor) -> bool:
    """Each row of one call equals the same row computed alone, bit for bit."""
    together = linear(x)
    return all(torch.equal(together[i : i + 1], linear(x[i : i + 1])) for i in range(x.shape[0]))


@pytest.mark.parametrize("backend", ROW_INVARIANT)
def test_quantised_rows_do_not_depend_on_the_call_width(backend):
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 128, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(17, 128, generator=gen) * torch.logspace(-2, 2, 17)[:, None]  # rows of very different scale
    linear = make_linear(backend, w, b)
    assert rows_invariant(linear, x)
    # and it computes the projection: close to the float one, relative to its scale
    want = torch.nn.functional.linear(x, w, b)
    assert ((linear(x) - want).norm() / want.norm()) < 0.1


def test_the_invariance_check_has_power():
    """fbgemm's dynamic int8 quantises a call's rows with one activation scale: rows of different
    scale change each other's results, and the check above must notice."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        pytest.skip("this torch build has no fbgemm")
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 128, generator=gen)
    x = torch.randn(17, 128, generator=gen) * torch.logspace(-2, 2, 17)[:, None]
    assert not rows_invariant(make_linear("int8-dynamic", w, None), x)


def test_int4_layout_holds_the_weights_it_was_built_from():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(64, 96, generator=gen)
    int4 = quantise_int4(w)
    assert int4.q.dtype == torch.uint8 and int(int4.q.max()) <= 15
    assert (int4.dequantise() - w).abs().max() < 0.6 * (w.max() - w.min()) / 15  # half a step, and bf16 rounding
    x = torch.randn(3, 96, generator=gen)
    got = Int4WeightOnlyLinear(w, None, int4)(x)
    want = x.bfloat16().float() @ int4.dequantise().t()
    assert torch.allclose(got, want, rtol=0.02, atol=0.05)


def test_int4_runs_int8_where_the_kernel_cannot_hold_the_shape():
    assert int4_linear(torch.randn(32, 64), None).kind == "int4"
    assert int4_linear(torch.randn(40, 64), None).kind == "int8"  # 40 output rows: not a multiple of 16


def test_precisions_the_device_cannot_run_are_one_line_errors():
    with pytest.raises(RuntimeUserError, match="no kernel on 'cuda'"):
        get_precision("int4", "cuda")
    with pytest.raises(RuntimeUserError, match="cannot be compiled"):
        get_precision("w8a8", "cpu", compiled=True)
    with pytest.raises(RuntimeUserError, match="unknown precision 'int3'"):
        get_precision("int3", "cpu")
    assert get_precision("bf16", "cpu").name == "bfloat16"
    assert get_precision("auto", "cuda").name == "bfloat16"


def _quantised(model: torch.nn.Module, backend: str) -> CausalLM:
    lm = CausalLM(model)
    lm.use_linear_backend(backend)
    return lm


@pytest.mark.parametrize("backend", ROW_INVARIANT)
def test_tiny_speculation_equals_plain_at_the_same_precision(backend):
    """Chain, tree and layer-skip drafting on a quantised target, against plain decoding of that
    quantised target (not the float model: its tokens differ)."""
    target_model = tiny_model("qwen2", 5, layers=3)
    target = _quantised(target_model, backend)
    draft = CausalLM(noisy_copy(target_model, 0.15, seed=6))
    prompt = [3, 14, 15, 9, 2, 6, 5, 3]
    cfg = GenerationConfig(max_new_tokens=40)
    want = Decoder(target).generate(prompt, cfg).tokens
    for shape in (TreeShape((1, 1, 1, 1)), TreeShape((3, 2, 1))):
        drafter = ModelDrafter(draft, target.dims.vocab, shape)
        got = Decoder(target, drafter, len(shape.widths), verify_width=shape.max_nodes() + 1).generate(prompt, cfg)
        assert got.tokens == want, (backend, shape)
        assert got.stats.drafted > 0 and sum(got.stats.accept_hist[2:]) > 0  # depth >= 2 accepted
    skip = SelfDrafter(target, LayerPlan(3, skip_attn=(1,)), TreeShape((1, 1, 1)))
    got = Decoder(target, skip, 3, verify_width=4).generate(prompt, cfg)
    assert got.tokens == want and got.stats.drafted > 0
    lookup = Decoder(target, PromptLookupDrafter(max_ngram=3, min_ngram=1), 4, verify_width=5)
    assert lookup.generate(prompt, cfg).tokens == want


# ------------------------------------------------------------------ SmolLM2, through the pipeline
@pytest.fixture(scope="module")
def qpool():
    return ModelPool()


def _prompt(model, task: str) -> list[int]:
    from studies import load_prompts, render_prompt

    tok = model.tokenizer
    return tok(render_prompt(load_prompts(task, None, 1)[0], tok), add_special_tokens=False)["input_ids"]


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_smollm_speculation_equals_plain_at_precision(qpool, precision):
    """Every drafting mode on SmolLM2 served at int8 / int4 equals plain decoding at that precision,
    token for token, with speculation asserted; the model id names the precision."""
    target = qpool.get("smollm2-135m", precision)
    assert target.model_id.endswith(f"#{precision}") and target.precision == precision
    assert qpool.get("smollm2-135m", "float32").hf_model is target.hf_model  # one module tree
    n = target.hf_model.config.num_hidden_layers
    cfg = GenerationConfig(max_new_tokens=32, eos_token_ids=eos_ids(target))
    other = "int4" if precision == "int8" else "int8"  # a draft that differs from the target
    strategies = [
        (Strategy(draft_length=4, draft_precision=other), "smollm2-135m"),
        (Strategy(draft_length=3, tree_widths=(3, 2, 1), draft_precision=other), "smollm2-135m"),
        (Strategy(draft_length=4, draft_precision="float32", layer_plan=easyspec_plan(n, 3)), "smollm2-135m"),
        (Strategy(drafter="layer-skip", draft_length=4, layer_plan=uniform_skip_plan(n, 0.2)), None),
        (Strategy(drafter="prompt-lookup", draft_length=6), None),
    ]
    for task in ("gsm8k", "humaneval"):
        ids = _prompt(target, task)
        plain = build_decoder(qpool, target, PLAIN)
        assert plain.target.backend == precision
        want = plain.generate(ids, cfg).tokens
        for strategy, draft in strategies:
            decoder = build_decoder(qpool, target, strategy, draft)
            assert decoder.target.backend == precision  # the verify runs the plain step's kernels
            got = decoder.generate(ids, cfg)
            assert got.tokens == want, (precision, task, strategy)
            if strategy.drafter != "prompt-lookup":
                assert got.stats.drafted > 0
        drafted = build_decoder(qpool, target, strategies[0][0], "smollm2-135m").generate(ids, cfg).stats
        assert sum(drafted.accept_hist[2:]) > 0  # depth >= 2 accepted


@pytest.mark.slow
def test_smollm_w8a8_chain_equals_plain(qpool):
    target = qpool.get("smollm2-135m", "w8a8")
    ids = _prompt(target, "humaneval")
    cfg = GenerationConfig(max_new_tokens=32, eos_token_ids=eos_ids(target))
    want = build_decoder(qpool, target, PLAIN).generate(ids, cfg).tokens
    got = build_decoder(qpool, target, Strategy(draft_length=5, draft_precision="int4"), "smollm2-135m").generate(ids, cfg)
    assert got.tokens == want and got.stats.drafted > 0 and sum(got.stats.accept_hist[2:]) > 0


# ------------------------------------------------------------------ int4 from the GGUF's own blocks
def _random_blocks(kind: str, rows: int, blocks: int, seed: int = 0):
    import numpy as np

    size = {"Q4_K": 144, "Q4_1": 20}[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, blocks * size), dtype=np.uint8)
    view = raw.reshape(rows, blocks, size)
    view[..., 0:2] = rng.uniform(0.001, 0.05, (rows, blocks)).astype(np.float16).view(np.uint8).reshape(rows, blocks, 2)
    view[..., 2:4] = rng.uniform(-0.05, 0.05, (rows, blocks)).astype(np.float16).view(np.uint8).reshape(rows, blocks, 2)
    return raw


@pytest.mark.parametrize("kind,blocks", [("Q4_K", 2), ("Q4_1", 8)])
def test_gguf_blocks_decode_as_ggufs_own_dequantiser_does(kind, blocks):
    """Our (q, scale, zero) of a GGUF 4-bit block give exactly the weights the gguf package's
    reference dequantiser gives (before the scale and zero are rounded to bf16)."""
    import gguf
    import numpy as np

    from runtime.gguf_int4 import DECODERS

    raw = _random_blocks(kind, 16, blocks)
    want = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, kind))
    q, scale, zero = DECODERS[kind](raw)
    assert q.min() >= 0 and q.max() <= 15 and q.shape == want.shape
    got = (q.reshape(16, -1, 32).astype(np.float32) - 8) * scale[..., None] + zero[..., None]
    np.testing.assert_array_equal(got.reshape(want.shape), want)


@pytest.mark.slow
def test_smollm_int4_comes_from_its_gguf_blocks_and_is_cached(tmp_path, monkeypatch):
    """SmolLM2's Q4_1 projections become int4 weights equal to the float32 weights Hugging Face
    dequantised from the same file (to bf16 rounding of scale and zero), rows in HF's order; the
    result is cached, and a second load reads the cache, not the GGUF."""
    import shutil

    import runtime.gguf_int4
    from runtime.loading import cache_root, prepare_int4

    cached = next((cache_root() / "models").glob("smollm2-135m-*"))
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path))
    (tmp_path / "models").mkdir()
    shutil.copytree(cached, tmp_path / "models" / cached.name, ignore=shutil.ignore_patterns("int4-*"))
    model = ModelPool().get("smollm2-135m", "int4")
    prepare_int4(model)
    linears = {n: m for n, m in model.hf_model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert "lm_head" in linears and not hasattr(linears.pop("lm_head"), "int4_weights")  # an int8 head
    for name, mod in linears.items():
        err = (mod.int4_weights.dequantise() - mod.weight).abs().max() / mod.weight.abs().max()
        assert err < 0.01, name  # bf16 rounding only (a re-quantisation would be ~4%)
    assert (tmp_path / "models" / cached.name / runtime.gguf_int4.CACHE_FILE).exists()

    def no_gguf(*args):
        raise AssertionError("the second load must read the cache")

    monkeypatch.setattr(runtime.gguf_int4, "read_gguf_int4", no_gguf)
    again = ModelPool().get("smollm2-135m", "int4")
    prepare_int4(again)
    name = "model.layers.0.mlp.down_proj"
    assert torch.equal(dict(again.hf_model.named_modules())[name].int4_weights.q, linears[name].int4_weights.q)


@pytest.mark.parametrize("heads,kv_heads", [(12, 2), (4, 4)])
def test_invariant_attention_rows_do_not_depend_on_the_call_width(heads, kv_heads):
    """With ``invariant=True`` a query row attends exactly as it would alone: a verify of 11 rows
    (packed GQA rows 66: the kernel's blocks 32 + 32 + 2) and a 1-row step agree bit for bit."""
    from runtime.attention import sdpa

    gen = torch.Generator().manual_seed(3)
    slots, dim, rows = 300, 64, 11
    k, v = torch.randn(kv_heads, slots, dim, generator=gen), torch.randn(kv_heads, slots, dim, generator=gen)
    q = torch.randn(heads, rows, dim, generator=gen)
    mask = torch.zeros(rows, slots, dtype=torch.bool)
    mask[:, :250] = True
    mask[:, 250 : 250 + rows] = torch.ones(rows, rows, dtype=torch.bool).tril()
    together = sdpa(q, k, v, mask, False, dim**-0.5, invariant=True)
    for t in range(rows):
        alone = sdpa(q[:, t : t + 1], k, v, mask[t : t + 1], False, dim**-0.5, invariant=True)
        assert torch.equal(together[:, t : t + 1], alone), t
    plain = sdpa(q, k, v, mask, False, dim**-0.5)
    assert torch.allclose(together, plain, atol=1e-5)  # the same attention, up to rounding
