"""The gguf precision: GGUF blocks on ggml's CPU kernels (``runtime.kernels``, ``runtime.gguf_blocks``).

Row invariance at 1..17 rows on every block type the packaged files hold (with a power check: a
kernel that sums a multi-row call another way fails it), Q4_K repacked by eight rows, ggml's block decoders against the gguf
package's reference dequantiser, unsupported types and missing kernels as one-line errors, and the
packaged models' own blocks read in place."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime import kernels
from runtime.errors import RuntimeUserError
from runtime.gguf_blocks import GgufLinear, GgufWeights, check_supported, quantise

# ggml type ids of every block type the packaged files hold (SmolLM2: Q4_1, Q8_0; Qwen: Q4_K, Q6_K, Q5_0, Q8_0)
PACKAGED_TYPES = {"Q4_1": 3, "Q5_0": 6, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}


def _weights(kind: str, n: int = 48, k: int = 512, seed: int = 0) -> tuple[torch.Tensor, GgufWeights]:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    t = PACKAGED_TYPES[kind]
    return w, GgufWeights(((kernels.load().quantize(w, t), t),), k)


def rows_invariant(linear, x: torch.Tensor) -> bool:
    """Every row of each call of 1..len(x) rows equals that row computed alone, bit for bit."""
    alone = [linear(x[i : i + 1]) for i in range(x.shape[0])]
    for width in range(1, x.shape[0] + 1):
        together = linear(x[:width])
        if not all(torch.equal(together[i : i + 1], alone[i]) for i in range(width)):
            return False
    return True


@pytest.mark.parametrize("kind", PACKAGED_TYPES)
def test_rows_do_not_depend_on_the_call_width(kind):
    w, blocks = _weights(kind)
    x = torch.randn(17, 512, generator=torch.Generator().manual_seed(1)) * torch.logspace(-2, 2, 17)[:, None]
    linear = GgufLinear(w, None, blocks)
    assert rows_invariant(linear, x)
    want = torch.nn.functional.linear(x, w)
    assert ((linear(x) - want).norm() / want.norm()) < 0.1  # it computes the projection


class ReorderedRows(GgufLinear):
    """A deliberately wrong kernel path: calls of several rows multiply the dequantised weights in
    float32 (another summation order); single rows take ggml's dot products."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            return super().__call__(x)
        return x.float() @ self.source.dequantise().t()


def test_the_invariance_check_has_power():
    w, blocks = _weights("Q4_K")
    x = torch.randn(17, 512, generator=torch.Generator().manual_seed(1))
    assert not rows_invariant(ReorderedRows(w, None, blocks), x)


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q5_0", "Q8_0"])
def test_the_multi_row_kernels_are_ggmls_vec_dot_bit_for_bit(kind):
    """Q4_K, Q6_K, Q5_0 and Q8_0 (the Qwen 0.5B draft's file is mostly Q5_0) decode each weight block
    once for several activation rows; every row still gets ggml's own vec_dot result, at every row
    count (remainders of the 4-row pass, a tile boundary)."""
    ops, t = kernels.load(), PACKAGED_TYPES[kind]
    if "avx2" in ops.cpu_features() and "fma" in ops.cpu_features():
        assert ops.has_rows_kernel(t)
    w = ops.quantize(torch.randn(24, 2560, generator=torch.Generator().manual_seed(3)), t)
    x = torch.randn(160, 2560, generator=torch.Generator().manual_seed(4)) * 3
    for m in (*range(1, 10), 31, 160):
        got, want = ops.matmul(x[:m], [w], [t]), ops.matmul(x[:m], [w], [t], by_vec_dot=True)
        assert torch.equal(got, want), m
    # the equality has power: the same products summed in float32 (dequantised weights) differ
    assert not torch.equal(x @ ops.dequantize(w, t, 2560).t(), ops.matmul(x, [w], [t]))


needs_repack = pytest.mark.skipif(not kernels.load().can_repack(PACKAGED_TYPES["Q4_K"]),
                                  reason="this CPU's build has no repacked Q4_K kernel (AVX2)")


@needs_repack
def test_repacked_q4_k_is_row_invariant_and_computes_ggmls_dot_products():
    """Q4_K repacked by eight rows (one kernel for every row count: four rows at a time, then the
    rest) gives each row the same bits at every call width, tile boundaries included, and the
    products vec_dot gives to within float32 rounding (its sums run in another order)."""
    ops, t = kernels.load(), PACKAGED_TYPES["Q4_K"]
    w = ops.quantize(torch.randn(40, 2560, generator=torch.Generator().manual_seed(3)), t)
    kept = w.clone()
    packed, rt = ops.repack(w, t, 2560, release_source=True), ops.repacked_type(t)
    assert packed.shape == (5, 10 * 1184)
    assert torch.equal(w, kept)  # paging the source out keeps its contents (here anonymous memory)
    x = torch.randn(160, 2560, generator=torch.Generator().manual_seed(4)) * 3
    alone = torch.cat([ops.matmul(x[i : i + 1], [packed], [rt]) for i in range(160)])
    for m in (*range(1, 10), 31, 160):
        assert torch.equal(ops.matmul(x[:m], [packed], [rt]), alone[:m]), m
    want = ops.matmul(x, [w], [t], by_vec_dot=True)
    assert not torch.equal(alone, want)  # another float order: the identity above is the kernel's own
    torch.testing.assert_close(alone, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@needs_repack
def test_only_whole_groups_of_eight_q4_k_rows_are_repacked():
    ops, q4k = kernels.load(), PACKAGED_TYPES["Q4_K"]
    parts = [_weights("Q4_K", n=16)[1], _weights("Q4_K", n=12, seed=1)[1], _weights("Q6_K", n=8, seed=2)[1]]
    linear = GgufLinear(torch.empty(36, 512), None, GgufWeights.cat(parts))
    assert linear.types == [ops.repacked_type(q4k), q4k, PACKAGED_TYPES["Q6_K"]]
    assert [s.shape[0] for s in linear.segments] == [2, 12, 8]
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(5))
    assert rows_invariant(linear, x)
    with pytest.raises(RuntimeError, match="by vec_dot"):
        ops.matmul(x, linear.segments[:1], linear.types[:1], by_vec_dot=True)


def test_a_fused_projection_computes_each_part_as_its_own_call_does():
    """Segments of different block types (Q4_K_M files mix Q4_K and Q6_K inside q/k/v) in one call."""
    parts = [_weights(kind, n=16 * (i + 1), seed=i)[1] for i, kind in enumerate(("Q4_K", "Q6_K", "Q5_0"))]
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(2))
    fused = GgufLinear(torch.empty(96, 512), None, GgufWeights.cat(parts))(x)
    separate = torch.cat([GgufLinear(torch.empty(p.rows_total, 512), None, p)(x) for p in parts], dim=1)
    assert torch.equal(fused, separate)


@pytest.mark.parametrize("kind", PACKAGED_TYPES)
def test_ggml_decodes_blocks_as_the_gguf_packages_reference_does(kind):
    import gguf

    _, blocks = _weights(kind)
    ((raw, t),) = blocks.segments
    want = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType(t))
    np.testing.assert_array_equal(blocks.dequantise().numpy(), want)


def test_models_without_blocks_are_quantised_as_llama_quantize_would():
    """Q4_K projections and a Q6_K head where rows are whole 256-element super-blocks; Q5_0 / Q8_0
    (llama.cpp's fallbacks) where they are not."""
    from runtime.gguf_blocks import HEAD_TYPES

    assert quantise(torch.randn(32, 512)).types == (PACKAGED_TYPES["Q4_K"],)
    assert quantise(torch.randn(32, 96)).types == (PACKAGED_TYPES["Q5_0"],)
    assert quantise(torch.randn(32, 512), HEAD_TYPES).types == (PACKAGED_TYPES["Q6_K"],)
    assert quantise(torch.randn(32, 96), HEAD_TYPES).types == (PACKAGED_TYPES["Q8_0"],)
    with pytest.raises(RuntimeUserError, match="multiple of 32"):
        quantise(torch.randn(32, 100))


def test_a_block_type_without_a_cpu_dot_product_is_refused_by_name():
    with pytest.raises(RuntimeUserError, match=r"blk\.0\.ffn_up\.weight holds Q8_K blocks.*--precision"):
        check_supported(15, "blk.0.ffn_up.weight")  # Q8_K: an activation type, no dot product of its own


def test_missing_kernels_are_one_line_errors(monkeypatch, tmp_path):
    from runtime.precision import get_precision

    monkeypatch.setattr(kernels, "library_path", lambda: tmp_path / "none.so")
    kernels.load.cache_clear()
    try:
        assert not kernels.available()
        with pytest.raises(RuntimeUserError, match=r"--precision gguf: ggml kernels are not built for this CPU.*make kernels"):
            get_precision("gguf", "cpu")
    finally:
        monkeypatch.undo()
        kernels.load.cache_clear()
    assert kernels.available()


def test_the_build_is_keyed_by_the_cpu_flags(monkeypatch):
    """A cache carried to a CPU with other instruction sets is never loaded there."""
    here = kernels.build_key()
    monkeypatch.setattr(kernels, "cpu_flags", lambda: "sse2")
    assert kernels.build_key() != here


@pytest.mark.slow
def test_packaged_blocks_are_the_files_own_and_memory_mapped(pool):
    """SmolLM2 at gguf runs its file's Q4_1 projections and its tied Q8_0 embedding as the head, in
    place: the blocks equal the file's bytes, and Hugging Face's dequantised weights (the float32
    tree's) are what ggml decodes them into."""
    import gguf

    from runtime.loading import kept_gguf
    from runtime.models import resolve_model

    model = pool.get("smollm2-135m", "gguf")
    mods = dict(model.hf_model.named_modules())
    up = mods["model.layers.3.mlp.up_proj"].gguf_weights
    head = mods["lm_head"].gguf_weights
    assert up.types == (PACKAGED_TYPES["Q4_1"],) and head.types == (PACKAGED_TYPES["Q8_0"],)
    reader = gguf.GGUFReader(str(kept_gguf(resolve_model("smollm2-135m"), "smollm2-135m")))
    raw = next(t for t in reader.tensors if t.name == "blk.3.ffn_up.weight")
    assert np.array_equal(up.segments[0][0].numpy(), np.asarray(raw.data))
    floats = dict(pool.get("smollm2-135m", "float32").hf_model.named_modules())
    assert torch.equal(up.dequantise(), floats["model.layers.3.mlp.up_proj"].weight.detach())


@pytest.mark.slow
def test_a_packaged_model_at_gguf_is_loaded_from_its_blocks_alone(pool):
    """No float weight of a projection, the head or the embedding exists at gguf: the tree holds the
    file's blocks, its embedding looks rows up in them, its norms and biases are the file's; and it
    computes bit for bit what the float32 tree with the same blocks attached computes (SmolLM2: a
    llama with reordered q/k rows and a tied embedding; the Qwen 0.5B: q/k/v biases)."""
    from runtime.gguf_model import GgufEmbedding
    from runtime.loading import at_precision, prepare_gguf
    from runtime.precision import PRECISIONS
    from runtime.transformer import CausalLM

    for name in ("smollm2-135m", "qwen2.5-coder-0.5b"):
        lean = pool.get(name, "gguf")
        tree = lean.hf_model
        assert lean.blocks_only and isinstance(tree.model.embed_tokens, GgufEmbedding)
        metas = {n for n, p in tree.named_parameters() if p.is_meta}
        linears = {n for n, m in tree.named_modules() if isinstance(m, torch.nn.Linear)}
        assert metas == {f"{n}.weight" for n in linears}  # nothing else lacks a value; these have none
        assert all(getattr(m, "gguf_weights", None) is not None for n, m in tree.named_modules() if n in linears)
        assert pool.get(name, "float32").hf_model is not tree  # never shared with a float precision

        floats = at_precision(pool.get(name, "float32"), PRECISIONS["gguf"])
        prepare_gguf(floats)
        reference = CausalLM(floats.hf_model)
        reference.use_linear_backend("gguf")
        served = pool.served(lean)
        ids = torch.tensor(lean.tokenizer("def fib(n):\n    return fib(n - 1) +").input_ids)
        with torch.inference_mode():
            got, want = served(ids, served.new_cache(64)), reference(ids, reference.new_cache(64))
        assert torch.equal(got, want), name
        assert lean.tokenizer.get_vocab() == floats.tokenizer.get_vocab()


def test_a_build_without_a_toolchain_fails_with_one_line(monkeypatch, capsys):
    from runtime.kernels import build

    monkeypatch.setattr(build.shutil, "which", lambda tool: None)
    assert build.main() == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no `cmake` on PATH" in err and "make kernels" in err


def test_a_failed_build_step_names_the_step_and_its_log(monkeypatch, tmp_path, capsys):
    from runtime.kernels import build

    monkeypatch.setattr(build, "library_path", lambda: tmp_path / "ext" / "none.so")
    monkeypatch.setattr(build, "kernel_dir", lambda: tmp_path)
    monkeypatch.setattr(build, "source_tree", lambda log: tmp_path / "no-such-tree")
    assert build.main() == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("ggml kernels: configuring ggml (cmake) failed") \
        and str(tmp_path / "build.log") in err
