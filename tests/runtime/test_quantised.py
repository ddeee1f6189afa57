"""Quantised precisions (int8, int4, w8a8, gguf) and float32 on oneDNN: row-invariant kernels, hence
speculative greedy output identical to plain greedy output at the same precision, on tiny models
and on SmolLM2."""
from __future__ import annotations

import pytest
import torch

from runtime.decoding import Decoder, GenerationConfig
from runtime.drafters import ModelDrafter, SelfDrafter, TreeShape
from runtime.errors import RuntimeUserError
from runtime.layout import Layout
from runtime.linear import FLOAT32_KERNEL_ENV, float32_cpu_backend, head_backend, make_linear, onednn_available
from runtime.lookup import PromptLookupDrafter
from runtime.pipeline import ModelPool, build_decoder, eos_ids
from runtime.precision import PRECISIONS, get_precision
from runtime.quant import Int4WeightOnlyLinear, int4_linear, quantise_int4
from runtime.testing import noisy_copy, tiny_model
from runtime.transformer import CausalLM
from search_spaces import PLAIN, Strategy, easyspec_plan, uniform_skip_plan
from search_spaces.layer_plan import LayerPlan

QUANTISED = [name for name, p in PRECISIONS.items() if p.quantised]
QUANTISED_ROW_INVARIANT = ["int8", "int4", "w8a8", "gguf"]
needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN float32 linear")
ROW_INVARIANT = [*QUANTISED_ROW_INVARIANT, pytest.param("onednn", marks=needs_onednn)]


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


def test_w8a8_computes_the_same_numbers_on_either_int8_kernel(monkeypatch):
    """oneDNN's pre-packed int8 linear (where present) and ``torch._int_mm`` give bit-identical
    outputs: the numbers a w8a8 model decodes do not depend on which kernel this torch has."""
    from runtime import quant

    if not quant.onednn_int8_available():
        pytest.skip("this torch build has no oneDNN int8 linear")
    gen = torch.Generator().manual_seed(2)
    w, b = torch.randn(96, 128, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(17, 128, generator=gen) * torch.logspace(-2, 2, 17)[:, None]
    packed = quant.W8A8Linear(w, b)
    monkeypatch.setattr(quant, "onednn_int8_available", lambda: False)
    plain = quant.W8A8Linear(w, b)
    assert packed.packed is not None and plain.packed is None
    for rows in (1, 2, 5, 17):
        assert torch.equal(packed(x[:rows]), plain(x[:rows]))


@needs_onednn
def test_onednn_float32_rows_equal_every_width_and_the_float_projection():
    """oneDNN's float32 GEMM computes a row the same at 1-17 rows and inside a 32-row call (a
    lone row runs as two), on the 1.5B's MLP shape, and within float32 rounding of F.linear."""
    gen = torch.Generator().manual_seed(3)
    w, b = torch.randn(896, 1536, generator=gen) * 0.02, torch.randn(896, generator=gen)
    x = torch.randn(32, 1536, generator=gen)
    linear = make_linear("onednn", w, b)
    together = linear(x)
    for rows in (1, 2, 3, 11, 16, 17):
        assert torch.equal(linear(x[:rows]), together[:rows]), rows
    assert torch.allclose(together, torch.nn.functional.linear(x, w, b), rtol=1e-4, atol=1e-4)


def test_float32_kernel_pin(monkeypatch):
    """float32 runs oneDNN on the CPU where present; the environment pins Hugging Face's dense
    arithmetic; anything else is a one-line error."""
    monkeypatch.delenv(FLOAT32_KERNEL_ENV, raising=False)
    assert float32_cpu_backend() == ("onednn" if onednn_available() else "dense")
    model = tiny_model("llama", 1, layers=2)
    pool = ModelPool()
    from runtime.loading import LoadedModel

    loaded = LoadedModel("tiny", "tiny", "0", model, None)
    assert pool.served(loaded).backend == float32_cpu_backend()
    assert ModelPool(compile=True).served(loaded).backend == "dense"  # compiled steps need dense weights
    monkeypatch.setenv(FLOAT32_KERNEL_ENV, "dense")
    assert pool.served(loaded).backend == "dense"
    monkeypatch.setenv(FLOAT32_KERNEL_ENV, "mkl")
    with pytest.raises(RuntimeUserError, match="AUTOTUNE_FLOAT32_KERNEL='mkl' is not a float32 kernel"):
        pool.served(loaded)


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
    with pytest.raises(RuntimeUserError, match="no backend on 'cuda'"):
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


PROMPT = [3, 14, 15, 9, 2, 6, 5, 3]


def assert_drafting_equals_plain(target: CausalLM, target_model: torch.nn.Module, label: object) -> list[int]:
    """Chain and tree drafting (a noisy float copy as draft, depth >= 2 accepted) and prompt lookup on
    ``target`` decode plain decoding's 40 tokens; returns them."""
    draft = CausalLM(noisy_copy(target_model, 0.15, seed=6))
    cfg = GenerationConfig(max_new_tokens=40)
    want = Decoder(target).generate(PROMPT, cfg).tokens
    for shape in (TreeShape((1, 1, 1, 1)), TreeShape((3, 2, 1))):
        drafter = ModelDrafter(draft, target.dims.vocab, shape)
        got = Decoder(target, drafter, len(shape.widths), verify_width=shape.max_nodes() + 1).generate(PROMPT, cfg)
        assert got.tokens == want, (label, shape)
        assert got.stats.drafted > 0 and sum(got.stats.accept_hist[2:]) > 0  # depth >= 2 accepted
    lookup = Decoder(target, PromptLookupDrafter(max_ngram=3, min_ngram=1), 4, verify_width=5)
    assert lookup.generate(PROMPT, cfg).tokens == want, label
    return want


@pytest.mark.parametrize("backend", ROW_INVARIANT)
def test_tiny_speculation_equals_plain_at_the_same_precision(backend):
    """Chain, tree and layer-skip drafting on a quantised target, against plain decoding of that
    quantised target (not the float model: its tokens differ)."""
    target_model = tiny_model("qwen2", 5, layers=3)
    target = _quantised(target_model, backend)
    want = assert_drafting_equals_plain(target, target_model, backend)
    skip = SelfDrafter(target, LayerPlan(3, skip_attn=(1,)), TreeShape((1, 1, 1)))
    got = Decoder(target, skip, 3, verify_width=4).generate(PROMPT, GenerationConfig(max_new_tokens=40))
    assert got.tokens == want and got.stats.drafted > 0


def test_speculation_equals_plain_on_repacked_q4_k_rows():
    """A model wide enough for Q4_K (rows of 256 values) runs its projections at gguf on Q4_K repacked
    by eight rows; chain and tree drafting and prompt lookup still decode plain decoding's tokens."""
    from runtime import kernels

    ops = kernels.load()
    if not ops.can_repack(12):
        pytest.skip("this CPU's build has no repacked Q4_K kernel (AVX2)")
    target_model = tiny_model("qwen2", 5, layers=2, hidden=256)
    target = _quantised(target_model, "gguf")
    assert ops.repacked_type(12) in {t for lin in target.linears[0].values() for t in lin.types}
    assert_drafting_equals_plain(target, target_model, "gguf, Q4_K repacked")


@pytest.mark.parametrize("backend", QUANTISED_ROW_INVARIANT)
def test_fused_projections_compute_each_part_bit_identically(backend, monkeypatch):
    """The quantised backends run q/k/v and gate/up as one call each (runtime.linear.FUSED_BACKENDS);
    every logit of steps and a verify equals what one call per projection gives, bit for bit."""
    import runtime.transformer as transformer

    model = tiny_model("qwen2", 5, layers=3)  # q/k/v with biases
    fused = _quantised(model, backend)
    assert set(fused.linears[0]) == {"qkv", "o", "gate_up", "down"}
    monkeypatch.setattr(transformer, "FUSED_BACKENDS", ())
    separate = _quantised(model, backend)
    assert set(separate.linears[0]) == {"q", "k", "v", "o", "gate", "up", "down"}
    tokens = torch.randint(0, 96, (8,), generator=torch.Generator().manual_seed(2))
    logits = []
    with torch.inference_mode():
        for lm in (fused, separate):
            cache = lm.new_cache(16)  # a 1-row first forward is a step, not a prefill
            logits.append([lm(tokens[:1], cache), lm(tokens[1:6], cache), lm(tokens[6:], cache)])
    assert all(torch.equal(a, b) for a, b in zip(*logits))


def test_an_int4_draft_runs_an_int4_head_and_a_target_never_does():
    """Drafts need not be exact: an int4 draft wrapper's head runs int4 (half the int8 head's time);
    a target's head stays int8 whatever wraps it."""
    model = tiny_model("qwen2", 5, layers=3)
    target = _quantised(model, "int4")
    draft = CausalLM(model)
    draft.use_linear_backend("int4", draft=True)
    assert target.head.kind == "int8" and draft.head.kind == "int4"
    shared = CausalLM(model)
    shared.share_linears_from(draft)
    assert shared.head is draft.head
    int8_draft = CausalLM(model)
    int8_draft.use_linear_backend("int8", draft=True)
    assert int8_draft.head.kind == "int8"


@pytest.mark.parametrize("backend", ROW_INVARIANT)
def test_quantised_tree_rows_equal_plain_steps(backend):
    """A tree verify's rows, whose ancestors sit scattered over the round's slots, compute the logits
    a plain step at their position computes, bit for bit, on every branch and across a 64-slot key
    block (the attended keys are gathered into a plain step's column order; left where the cache
    holds them, most rows differ in the last ulp, see ``test_gathered_keys_are_needed``)."""
    from runtime.tree import compile_tree, tree_tables

    lm = _quantised(tiny_model("qwen2", 5, layers=3), backend)
    prompt = torch.randint(0, 96, (250,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.inference_mode():
        plain = lm.new_cache(300)
        logits = [lm(torch.tensor(prompt), plain)[-1]]
        for _ in range(6):
            logits.append(lm(logits[-1].argmax().view(1), plain)[0])
        greedy = [int(x.argmax()) for x in logits]  # greedy[i] sits at position 250 + i
        # root = greedy[0] (position 250); two branches at every depth, the greedy path on the second
        parents = (-1, -1, 0, 1, 1, 4, 5, 6, 7)
        tokens = [7, greedy[1], 9, 11, greedy[2], greedy[3], greedy[4], greedy[5], 13]
        tree = compile_tree(parents)
        tables = tree_tables(tree, "cpu")
        cache = lm.new_cache(300)
        lm(torch.tensor(prompt), cache)
        got = lm(torch.tensor([greedy[0], *tokens]), cache, Layout.block(tables.block, tables.offsets + 250))
    assert torch.equal(got[0], logits[1])  # the root: slot == position
    for row, depth in ((2, 1), (5, 2), (6, 3), (7, 4), (8, 5)):  # nodes 1, 4, 5, 6, 7: the greedy path
        assert torch.equal(got[row], logits[1 + depth]), (row, depth)


def test_gathered_keys_are_needed():
    """The power of the check above: one query attending to the same keys laid out in the cache's
    columns as a tree round leaves them differs in the last ulp from a plain step's layout."""
    from runtime.attention import _in_blocks

    gen = torch.Generator().manual_seed(3)
    dim, rep, differ = 64, 3, 0
    for start in range(100, 140):
        k, v = torch.randn(3, 256, dim, generator=gen), torch.randn(3, 256, dim, generator=gen)
        q = torch.randn(3, rep, dim, generator=gen)
        scattered_k, scattered_v = k.clone(), v.clone()
        ancestors = [start + 1, start + 4, start + 7]  # depths 1-3 at the slots of a tree round
        for depth, slot in enumerate(ancestors, 1):
            scattered_k[:, slot], scattered_v[:, slot] = k[:, start + depth], v[:, start + depth]
        contiguous = torch.arange(256)[None, :] <= start + 3
        scattered = torch.arange(256)[None, :] <= start
        scattered[0, ancestors] = True
        a = _in_blocks(q, k, v, contiguous.repeat(rep, 1), dim**-0.5)
        b = _in_blocks(q, scattered_k, scattered_v, scattered.repeat(rep, 1), dim**-0.5)
        assert torch.allclose(a, b, atol=1e-5)
        differ += not torch.equal(a, b)
    assert differ > 0

# ------------------------------------------------------------------ SmolLM2, through the pipeline
@pytest.fixture(scope="module")
def qpool():
    return ModelPool()


def _prompt(model, task: str) -> list[int]:
    from studies import load_prompts, render_prompt

    tok = model.tokenizer
    return tok(render_prompt(load_prompts(task, None, 1)[0], tok), add_special_tokens=False)["input_ids"]


@pytest.mark.slow
@pytest.mark.parametrize("precision", [
    # heavy: the matrix beyond the default precision (gguf), each about as long as gguf's; their kernels'
    # identity stays in the default run on tiny models (test_tiny_speculation_equals_plain_at_the_same_precision)
    pytest.param("int8", marks=pytest.mark.heavy),
    pytest.param("int4", marks=pytest.mark.heavy),
    "gguf",
])
def test_smollm_speculation_equals_plain_at_precision(qpool, precision):
    """Every drafting mode on SmolLM2 served at int8 / int4 / gguf (its file's Q4_1 and Q8_0 blocks) equals plain decoding at that precision,
    token for token, with speculation asserted; the model id names the precision."""
    target = qpool.get("smollm2-135m", precision)
    assert target.model_id.endswith(f"#{precision}") and target.precision == precision
    # one float module tree for every float-weight precision; gguf's own, built from the file's blocks alone
    own = target.blocks_only
    assert own == (precision == "gguf") and (qpool.get("smollm2-135m", "float32").hf_model is target.hf_model) != own
    n = target.hf_model.config.num_hidden_layers
    cfg = GenerationConfig(max_new_tokens=32, eos_token_ids=eos_ids(target))
    other = "int4" if precision == "int8" else "int8"  # a draft that differs from the target
    strategies = [
        (Strategy(draft_length=4, draft_precision=other), "smollm2-135m"),
        (Strategy(draft_length=3, tree_widths=(3, 2, 1), draft_precision=other), "smollm2-135m"),
        (Strategy(draft_length=4, draft_precision="float32", layer_plan=easyspec_plan(n, 3)), "smollm2-135m"),
        (Strategy(drafter="layer-skip", draft_length=4, layer_plan=uniform_skip_plan(n, 0.2)), None),
        (Strategy(drafter="prompt-lookup", draft_length=6), None),
        # an EasySpec draft at the target's precision: at gguf its groups run each member on the blocks (loop)
        (Strategy(draft_length=4, draft_precision=precision, layer_plan=easyspec_plan(n, 3)), "smollm2-135m"),
    ]
    for task in ("gsm8k", "humaneval"):
        ids = _prompt(target, task)
        plain = build_decoder(qpool, target, PLAIN)
        assert plain.target.backend == precision
        want = plain.generate(ids, cfg).tokens
        for strategy, draft in strategies:
            decoder = build_decoder(qpool, target, strategy, draft)
            assert decoder.target.backend == precision  # the verify runs the plain step's kernels
            if strategy.draft_precision == precision:
                assert decoder.drafter.model.group_executor == ("loop" if precision == "gguf" else "batched")
            got = decoder.generate(ids, cfg)
            assert got.tokens == want, (precision, task, strategy)
            if strategy.drafter != "prompt-lookup":
                assert got.stats.drafted > 0
        chain = build_decoder(qpool, target, strategies[0][0], "smollm2-135m")
        assert chain.target.head.kind == head_backend(precision) and chain.drafter.model.head.kind == other  # an int4 draft's head is int4
        drafted = chain.generate(ids, cfg).stats
        assert sum(drafted.accept_hist[2:]) > 0  # depth >= 2 accepted


@pytest.mark.slow
@pytest.mark.heavy  # the SmolLM2 matrix beyond gguf (w8a8's rows: test_tiny_speculation_equals_plain_at_the_same_precision)
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
def test_invariant_attention_rows_depend_on_their_slot_only(heads, kv_heads):
    """A query row attends bit-identically whatever shares its call and however big the cache is:
    a verify of 11 rows (packed GQA rows 66: the kernel's blocks 32 + 32 + 2) in a 300-slot cache
    and 1-row steps in caches of other capacities agree bit for bit. Attending over the whole
    capacity, as the float path does, fails the same check (its power)."""
    from runtime.attention import InvariantRows, key_blocks, round_keys, sdpa, sdpa_invariant

    gen = torch.Generator().manual_seed(3)
    start, dim, rows = 250, 64, 11
    k, v = torch.randn(kv_heads, 512, dim, generator=gen), torch.randn(kv_heads, 512, dim, generator=gen)
    q = torch.randn(heads, rows, dim, generator=gen)

    def mask(slots: range, capacity: int) -> torch.Tensor:  # causal over the cache's slots
        return torch.arange(capacity)[None, :] <= torch.tensor(list(slots))[:, None]

    blocks = key_blocks(start, rows)
    assert blocks == ((0, 6, 256), (6, 11, 320))  # slots 250-255 see 256 keys, 256-260 see 320
    cap = round_keys(300)
    together = sdpa_invariant(q, k[:, :cap], v[:, :cap], mask(range(start, start + rows), cap), dim**-0.5,
                              InvariantRows(blocks))
    whole_capacity_differs = False
    for t in range(rows):
        slot = start + t
        for capacity in (round_keys(slot + 1), 512):
            alone = sdpa_invariant(q[:, t : t + 1], k[:, :capacity], v[:, :capacity], mask(range(slot, slot + 1), capacity),
                                   dim**-0.5, InvariantRows.contiguous(slot, 1))
            assert torch.equal(together[:, t : t + 1], alone), (t, capacity)
        small, big = (sdpa(q[:, t : t + 1], k[:, :c], v[:, :c], mask(range(slot, slot + 1), c), False, dim**-0.5)
                      for c in (slot + 2, 512))
        whole_capacity_differs |= not torch.equal(small, big)
        assert torch.allclose(small, together[:, t : t + 1], atol=1e-5)  # the same attention, up to rounding
    assert whole_capacity_differs


def test_quantised_decode_does_not_depend_on_the_cache_capacity():
    """Plain decoding of an int4 model with a cache sized for plain decoding and with ones sized for
    a wide verify computes the same logits bit for bit (the int4 1.5B once parted on a near-tie,
    MT-Bench prompt 84 token 95, because attention read the cache's whole capacity)."""
    lm = _quantised(tiny_model("qwen2", 5, layers=3), "int4")
    prompt = torch.randint(0, 96, (240,), generator=torch.Generator().manual_seed(1)).tolist()

    def decode(capacity: int) -> list[torch.Tensor]:
        cache = lm.new_cache(capacity)
        out = [lm(torch.tensor(prompt), cache)[-1]]
        for _ in range(24):
            out.append(lm(out[-1].argmax().view(1), cache)[0])
        return out

    with torch.inference_mode():
        want = decode(266)
        for capacity in (270, 300, 400, 512):
            got = decode(capacity)
            assert all(torch.equal(a, b) for a, b in zip(want, got)), capacity


def test_quantised_prefill_runs_bf16_copies_shared_between_wrappers():
    """Where the CPU has bf16 GEMMs, an int4 model's prefill runs bf16 copies of its weights, built
    once for every wrapper sharing its linears; the prompt's next-token logits stay close to what the
    int4 steps compute, and the steps after it still run the int4 kernels."""
    from runtime.linear import bf16_prefill

    model = tiny_model("qwen2", 5, layers=3)
    lm = _quantised(model, "int4")
    if not bf16_prefill("int4"):
        assert lm.prefill_linears() is lm.linears
        pytest.skip("no native bf16 GEMM on this CPU: the prefill runs the int4 kernels")
    other = CausalLM(model)
    other.share_linears_from(lm)
    prefill = lm.prefill_linears()
    assert prefill[0]["q"].kind == "bf16" and lm.linears[0]["qkv"].kind == "int4"
    assert other.prefill_linears() is prefill
    prompt = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        by_prefill = lm(prompt, lm.new_cache(64))[-1]
        cache = lm.new_cache(64)
        lm(prompt[:1], cache)
        by_steps = lm(prompt[1:], cache)[-1]  # not a prefill: the int4 kernels
    assert not torch.equal(by_prefill, by_steps)
    assert torch.allclose(by_prefill, by_steps, atol=0.15 * by_steps.abs().max().item())
