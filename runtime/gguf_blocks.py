"""A model's projections as GGUF blocks for the ``gguf`` precision (``runtime.linear.GgufLinear``).

A packaged model's blocks are the file's own (Q4_K, Q6_K, Q5_0, Q8_0, Q4_1, ...), memory-mapped
from the joined GGUF file kept in the model's cache directory: nothing is dequantised and
requantised. Any other model (hub, local directory, random weights) is quantised at load by ggml's
own quantiser, as llama.cpp's quantize tool would for a Q4_K_M file: projections Q4_K and the head
Q6_K, or Q5_0 / Q8_0 where a row is not a multiple of 256 elements. A block type ggml has no CPU dot
product for is refused with one line that names it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runtime.errors import RuntimeUserError
from runtime.gguf_int4 import LAYER_TENSORS, llama_rows

# ggml type ids (ggml.h's enum ggml_type; the gguf package's GGMLQuantizationType holds the same)
Q4_K, Q6_K, Q5_0, Q8_0 = 12, 14, 6, 8
SUPER_BLOCK = 256  # the k-quants' super-block
# what ggml quantises a model without GGUF blocks into: (type, fallback where rows are not whole super-blocks)
PROJECTION_TYPES = (Q4_K, Q5_0)
HEAD_TYPES = (Q6_K, Q8_0)


@dataclass(frozen=True)
class GgufWeights:
    """A matrix as ggml blocks: one or more segments of output rows, each ``uint8 [N_i, row_bytes]``
    of one ggml type, over rows of ``k`` input elements (several segments: a fused projection)."""

    segments: tuple[tuple[torch.Tensor, int], ...]
    k: int

    @property
    def rows_total(self) -> int:
        return sum(data.shape[0] for data, _ in self.segments)

    @property
    def types(self) -> tuple[int, ...]:
        return tuple(t for _, t in self.segments)

    def rows(self, n: int) -> "GgufWeights":
        """The first ``n`` output rows (a restricted head)."""
        out, left = [], n
        for data, t in self.segments:
            if left <= 0:
                break
            out.append((data[:left], t))
            left -= data.shape[0]
        return GgufWeights(tuple(out), self.k)

    @staticmethod
    def cat(parts: "list[GgufWeights]") -> "GgufWeights":
        """Several matrices stacked along the output rows (one fused projection): their segments."""
        if len({p.k for p in parts}) != 1:
            raise ValueError("GGUF weights with different input sizes cannot be stacked")
        return GgufWeights(tuple(seg for p in parts for seg in p.segments), parts[0].k)

    def dequantise(self) -> torch.Tensor:
        from runtime.kernels import load

        ops = load()
        return torch.cat([ops.dequantize(data, t, self.k) for data, t in self.segments])


def type_name(ggml_type: int) -> str:
    import gguf

    try:
        return gguf.GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


def check_supported(ggml_type: int, tensor: str) -> None:
    from runtime.kernels import load

    if not load().has_dot(ggml_type):
        raise RuntimeUserError(
            f"{tensor} holds {type_name(ggml_type)} blocks, which the gguf precision cannot run "
            "(ggml has no CPU dot product for them); use --precision int4, w8a8 or float32 for this model")


def quantise(weight: torch.Tensor, types: tuple[int, int] = PROJECTION_TYPES) -> GgufWeights:
    """``weight [N, K]`` quantised by ggml into ``types[0]``, or ``types[1]`` where ``K`` is not a
    multiple of 256 (llama.cpp's own fallback for k-quants)."""
    from runtime.kernels import load

    n, k = weight.shape
    chosen = types[0] if k % SUPER_BLOCK == 0 else types[1]
    if k % 32:
        raise RuntimeUserError(f"a {n}x{k} projection cannot be held in GGUF blocks (rows must be a multiple of 32)")
    return GgufWeights(((load().quantize(weight.detach().float().contiguous(), chosen), chosen),), k)


def _tensor_rows(t: Any) -> torch.Tensor:
    data = np.asarray(t.data)
    return torch.from_numpy(data if data.flags.writeable else data.copy())


def read_gguf_blocks(path: Path, config: Any) -> dict[str, GgufWeights]:
    """The file's own blocks of every layer projection and of the head (``output.weight``, else the
    tied ``token_embd.weight``), by HF module path, in the HF module's row order; memory-mapped
    (copy-on-write), never copied but for llama's reordered q/k rows."""
    from runtime.gguf_file import read_index

    return blocks_from_index(read_index(path), config)[0]


def blocks_from_index(index: Any, config: Any) -> tuple[dict[str, GgufWeights], GgufWeights | None]:
    """``read_gguf_blocks`` of a file's tensors (``runtime.gguf_file.read_index``), and the token
    embedding's blocks (None where the file has none)."""
    out: dict[str, GgufWeights] = {}
    head = embedding = None
    for t in index.tensors:
        parts = t.name.split(".")
        if t.name in ("output.weight", "token_embd.weight"):
            if t.name == "output.weight" or head is None:
                head = t
            if t.name == "token_embd.weight":
                embedding = GgufWeights(((_tensor_rows(t), int(t.tensor_type)),), int(t.shape[0]))
            continue
        if len(parts) != 4 or parts[0] != "blk" or parts[2] not in LAYER_TENSORS or parts[3] != "weight":
            continue
        kind = int(t.tensor_type)
        check_supported(kind, t.name)
        rows = _tensor_rows(t)
        if config.model_type == "llama" and parts[2] in ("attn_q", "attn_k"):
            heads = config.num_attention_heads if parts[2] == "attn_q" else config.num_key_value_heads
            rows = rows[torch.from_numpy(llama_rows(rows.shape[0], heads))].contiguous()
        out[f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}"] = GgufWeights(((rows, kind),), int(t.shape[0]))
    if head is not None:
        check_supported(int(head.tensor_type), head.name)
        out["lm_head"] = GgufWeights(((_tensor_rows(head), int(head.tensor_type)),), int(head.shape[0]))
    return out, embedding


def gguf_weights(hf_model: Any, path: Path | None) -> dict[str, GgufWeights]:
    """GGUF blocks for every linear of ``hf_model``: the file's own where ``path`` holds them,
    quantised by ggml from the float weights otherwise."""
    from_file = read_gguf_blocks(path, hf_model.config) if path is not None else {}
    out = {}
    for name, mod in hf_model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            out[name] = from_file.get(name) or quantise(mod.weight, HEAD_TYPES if name == "lm_head" else PROJECTION_TYPES)
    return out


def attach(hf_model: Any, weights: dict[str, GgufWeights]) -> None:
    """Give each linear its GGUF blocks (``runtime.transformer`` passes them to the backend)."""
    for name, mod in hf_model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name in weights:
            mod.gguf_weights = weights[name]


def runnable(ops: Any, weights: GgufWeights) -> tuple[list[torch.Tensor], list[int]]:
    """The segments and types ``matmul`` runs: Q4_K segments of whole groups of eight rows repacked by
    eight (``runtime/kernels/repacked.h``: one kernel for every row count, so still row-invariant)
    where this CPU's build has that kernel (the file's pages they came from are paged out: the step
    never reads them); every other segment as the file holds it."""
    segments, types = [], []
    for data, t in weights.segments:
        packed = ops.repack(data, t, weights.k, release_source=True) if ops.can_repack(t) else None
        segments.append(data if packed is None else packed)
        types.append(t if packed is None else ops.repacked_type(t))
    return segments, types


class GgufLinear:
    """``y = x W^T + b`` over GGUF blocks on ggml's kernels (``runtime.kernels``): each activation
    row quantised on its own into the block type's dot-product type, one dot product per weight row
    and activation row, so every row is computed the same whatever the call's width (row-invariant);
    Q4_K repacked by eight rows (``runnable``).
    Without blocks (``source`` None), ``weight`` is quantised by ggml into Q4_K (Q5_0)."""

    kind = "gguf"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, source: GgufWeights | None = None) -> None:
        from runtime.kernels import load

        self.ops = load()
        self.source = source if source is not None else quantise(weight)
        self.out_dtype = weight.dtype if weight.is_floating_point() else torch.float32
        self.segments, self.types = runnable(self.ops, self.source)
        self.bias = None if bias is None else bias.detach().to(torch.float32)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ops.matmul(x.float(), self.segments, self.types)
        if self.bias is not None:
            y = y + self.bias
        return y if self.out_dtype == torch.float32 else y.to(self.out_dtype)
