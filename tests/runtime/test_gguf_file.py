"""The GGUF tensor index (``runtime.gguf_file``) against the ``gguf`` package's own reader: the same
tensors, types, shapes and bytes, having stepped over the metadata (string arrays, a custom
alignment) by its lengths alone."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from runtime.errors import RuntimeUserError
from runtime.gguf_file import read_index


def _same_as_the_reader(path: Path) -> None:
    import gguf

    ours, theirs = read_index(path).tensors, gguf.GGUFReader(str(path)).tensors
    assert [t.name for t in ours] == [t.name for t in theirs]
    for a, b in zip(ours, theirs):
        want = np.asarray(b.data)
        assert a.tensor_type == int(b.tensor_type) and a.shape == tuple(int(d) for d in b.shape), a.name
        assert a.data.dtype == want.dtype and a.data.shape == want.shape and np.array_equal(a.data, want), a.name


def _tiny_file(path: Path) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_custom_alignment(64)  # not the default 32: a reader that assumed it would misplace every tensor
    w.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc", "dddd"] * 50)
    w.add_array("tokenizer.ggml.scores", [0.5] * 200)
    w.add_string("general.name", "tiny")
    w.add_tensor("output_norm.weight", np.arange(64, dtype=np.float32))
    rows = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    w.add_tensor("blk.0.ffn_up.weight", gguf.quants.quantize(rows, gguf.GGMLQuantizationType.Q8_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_norm.weight", np.ones((3, 32), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_the_index_holds_what_the_gguf_reader_reads(tmp_path):
    _same_as_the_reader(_tiny_file(tmp_path / "tiny.gguf"))


def test_a_file_that_is_not_gguf_or_is_cut_short_is_one_line(tmp_path):
    other = tmp_path / "model.bin"
    other.write_bytes(b"PK\x03\x04" + bytes(60))
    with pytest.raises(RuntimeUserError, match="is not a GGUF file"):
        read_index(other)
    whole = _tiny_file(tmp_path / "tiny.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[: len(whole) - 100])
    with pytest.raises(RuntimeUserError, match="is truncated: tensor blk.0.attn_norm.weight"):
        read_index(cut)


@pytest.mark.slow
def test_the_packaged_file_indexes_as_the_reader_reads_it():
    from runtime.loading import kept_gguf
    from runtime.models import resolve_model

    _same_as_the_reader(kept_gguf(resolve_model("smollm2-135m"), "smollm2-135m"))


def test_an_empty_file_or_an_unknown_tensor_type_is_one_line(tmp_path):
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(RuntimeUserError, match="is not a GGUF file"):
        read_index(empty)
    data = bytearray(_tiny_file(tmp_path / "tiny.gguf").read_bytes())
    name = b"blk.0.ffn_up.weight"
    at = data.index(name) + len(name) + 4 + 8 * 2  # past the name, n_dims and two dims: the type id
    data[at:at + 4] = (999).to_bytes(4, "little")
    odd = tmp_path / "odd.gguf"
    odd.write_bytes(bytes(data))
    with pytest.raises(RuntimeUserError, match="is not a GGUF file this runtime reads .*999"):
        read_index(odd)
