"""Linear-layer backends: how a projection ``y = x W^T + b`` is executed.

- ``dense``: ``F.linear`` on the model's own weights (exact; plain decoding is bit-identical to HF).
- ``mkl-packed``: float32 weights repacked by MKL for one batch width ``M``; a GEMM with exactly ``M``
  rows then costs about as much as one row on CPU (used for the target's verify pass, whose width
  is fixed by the strategy). Other widths fall back to ``F.linear`` on the original weights.
- ``onednn``: float32 weights reordered once into oneDNN's blocked layout. Row-invariant from two
  rows on (a lone row is run as two), so every width computes a row the same; on CPUs where MKL
  takes a slow path (AMD) it runs at twice ``dense``'s speed and more (``FLOAT32_CPU_BACKEND``).
- ``int8``, ``int4``, ``w8a8``: quantised weights on torch's CPU kernels, row-invariant (a width-k
  verify computes each row exactly as a width-1 step does), so they serve targets losslessly
  relative to themselves; ``int8-dynamic``: fbgemm's dynamic int8, drafts only (``runtime.quant``).
- ``gguf``: the GGUF file's own blocks on ggml's CPU kernels (llama.cpp's), row-invariant by
  construction (``runtime.gguf_blocks``).
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from runtime.errors import RuntimeUserError
from runtime.gguf_blocks import GgufLinear
from runtime.kernels import available as ggml_kernels_available
from runtime.quant import (
    Bf16Linear, Int8DynamicLinear, Int8WeightOnlyLinear, W8A8Linear, fbgemm_available, int4_linear, int_mm_available,
    weight_only_available,
)


class Linear(Protocol):
    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...  # [T, in] -> [T, out]


class DenseLinear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


# backends whose many-row calls cost far more than a bfloat16 GEMM: their prefill runs bf16 copies
# of the same weights where the CPU has native bf16 GEMMs (AMX or AVX512-BF16)
BF16_PREFILL_BACKENDS = ("int8", "int4")


def bf16_prefill(backend: str) -> bool:
    return backend in BF16_PREFILL_BACKENDS and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def prefill_linear(weight: torch.Tensor, bias: torch.Tensor | None, source: Any = None) -> Bf16Linear:
    """The prefill's projection: ``source`` (int4 weights read from a GGUF file) dequantised, else
    the module's own weights, in bf16."""
    return Bf16Linear(weight if source is None else source.dequantise().to(weight.dtype), bias)


class MklPackedLinear:
    """float32 GEMM with weights prepacked for exactly ``width`` rows (CPU builds with MKL)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, width: int) -> None:
        self.weight, self.bias, self.width = weight, bias, width
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), width)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] != self.width:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkl._mkl_linear(x, self.packed, self.weight, self.bias, self.width)


class OneDnnLinear:
    """float32 GEMM on oneDNN, the weights reordered once into its blocked layout (a second copy;
    the module keeps its own for everything that reads it).

    oneDNN computes a row bit-identically whatever the call's row count and the row's batch-mates
    from two rows on; one row alone takes another path (a different last ulp), so it runs as two
    (``python tools/batch_steps.py --kernels`` times the cost). Every width therefore computes a row
    as any other does, like the quantised kernels (``ROW_INVARIANT_BACKENDS``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.bias = None if bias is None else bias.detach().contiguous()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), ONEDNN_ROWS_HINT)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            return torch.ops.mkldnn._linear_pointwise(torch.cat([x, x]), self.packed, self.bias, "none", [], "")[:1]
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")


# the row count oneDNN's weight layout is chosen for (a batched step's usual rows): results do not
# depend on it (the same 512 rows at hints 1, 2, 16 and 128; ``tools/batch_steps.py --kernels``)
ONEDNN_ROWS_HINT = 16


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


# which backend a float32 model runs on the CPU (``runtime.precision.Precision.backend_on``): ``onednn``
# where available (row-invariant, and faster than ``dense`` at every width: ``tools/batch_steps.py``);
# ``dense`` is Hugging Face's own arithmetic (MKL), bit-identical to its float32 forward. The
# environment variable pins either.
FLOAT32_CPU_BACKEND = "onednn"
FLOAT32_KERNEL_ENV = "AUTOTUNE_FLOAT32_KERNEL"
FLOAT32_KERNELS = ("onednn", "dense")


def float32_cpu_backend() -> str:
    """The linear backend float32 models run on the CPU (``FLOAT32_CPU_BACKEND`` unless
    ``$AUTOTUNE_FLOAT32_KERNEL`` pins one; ``dense`` where oneDNN is missing)."""
    chosen = os.environ.get(FLOAT32_KERNEL_ENV, "").strip() or FLOAT32_CPU_BACKEND
    if chosen not in FLOAT32_KERNELS:
        raise RuntimeUserError(f"{FLOAT32_KERNEL_ENV}={chosen!r} is not a float32 kernel; "
                               f"set it to one of {', '.join(FLOAT32_KERNELS)} or unset it")
    return chosen if chosen == "dense" or onednn_available() else "dense"


def run_rows(lin: Linear, x: torch.Tensor, way: str = "packed") -> torch.Tensor:
    """``lin`` over ``x`` ``[R, in]``, the rows of several sequences (a batched step). A packed
    fp32 GEMM runs them as ``way`` says:

    - ``packed``: in calls of exactly its width (the last padded). Its rows are then computed as a
      verify pass computes them, whoever shares the call: a call's row count changes MKL's kernel,
      and with it a row's last ulp, but inside a call of fixed width a row's result does not
      depend on the other rows.
    - ``dense``: one ``F.linear``, two rows as they are, more padded to a multiple of
      ``DENSE_ROWS``. MKL's fp32 GEMM costs a single row's time for two rows and reads the weights
      once from 16 rows on, but much more per row in between (measured on this machine's Xeon).

    The serving worker times both ways at several row counts and picks per count
    (``CausalLM.row_ways``). Single rows and the other backends run as they are."""
    rows = x.shape[0]
    if not isinstance(lin, MklPackedLinear) or rows in (1, lin.width):
        return lin(x)
    if way == "dense":
        pad = 0 if rows <= 2 else -rows % DENSE_ROWS
        xs = torch.cat([x, x[-1:].expand(pad, -1)]) if pad else x
        return F.linear(xs, lin.weight, lin.bias)[:rows]
    w = lin.width
    pad = -rows % w
    xs = torch.cat([x, x[-1:].expand(pad, -1)]) if pad else x
    return torch.cat([lin(chunk) for chunk in xs.split(w)])[:rows]


ROW_WAYS = ("packed", "dense")  # how a packed GEMM runs a batched step's rows (run_rows)
DENSE_ROWS = 16


def row_way(ways: dict[int, str], rows: int) -> str:
    """The way chosen for the smallest timed row count >= ``rows`` (the largest timed beyond
    them; ``packed`` when nothing was timed)."""
    if not ways:
        return "packed"
    fits = [r for r in ways if r >= rows]
    return ways[min(fits)] if fits else ways[max(ways)]


def mkl_packing_available() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


# (weight, bias, width, prepared quantised weights or None) -> Linear
LinearFactory = Callable[[torch.Tensor, "torch.Tensor | None", int, Any], Linear]

LINEAR_BACKENDS: dict[str, LinearFactory] = {
    "dense": lambda w, b, width, src: DenseLinear(w, b),
    "mkl-packed": lambda w, b, width, src: MklPackedLinear(w, b, width),
    "onednn": lambda w, b, width, src: OneDnnLinear(w, b),
    "int8-dynamic": lambda w, b, width, src: Int8DynamicLinear(w, b),
    "int8": lambda w, b, width, src: Int8WeightOnlyLinear(w, b),
    "int4": lambda w, b, width, src: int4_linear(w, b, src),
    "w8a8": lambda w, b, width, src: W8A8Linear(w, b),
    "gguf": lambda w, b, width, src: GgufLinear(w, b, src),
}

BACKEND_AVAILABLE: dict[str, Callable[[], bool]] = {
    "dense": lambda: True,
    "mkl-packed": mkl_packing_available,
    "onednn": onednn_available,
    "int8-dynamic": fbgemm_available,
    "int8": weight_only_available,
    "int4": weight_only_available,
    "w8a8": int_mm_available,
    "gguf": ggml_kernels_available,
}


# backends whose rows are invariant to the call's row count (runtime.quant): models running them get
# width-invariant attention too (runtime.attention.sdpa), so every width computes a row the same
ROW_INVARIANT_BACKENDS = ("int8", "int4", "w8a8", "gguf", "onednn")
# row-invariant backends whose float32 rows attend through the ggml extension's row-by-row attention
# (runtime.attention.attend_rows) rather than padded SDPA calls (runtime.attention.sdpa_invariant)
ROW_ATTENTION_BACKENDS = ("gguf",)

# backends whose output columns are computed independently of each other: one call over several
# projections' concatenated weights (q/k/v, gate/up) gives each part bit-identically what its own
# call gives (tests/runtime/test_quantised.py), for fewer calls and casts per layer (a step of the
# int4 1.5B: 28 x 7 -> 28 x 4 calls; its time moved within noise). float32 and bf16 GEMMs may block differently by width, so
# they keep one call per projection (dense float32 is bit-identical to Hugging Face's forward).
FUSED_BACKENDS = ("int8", "int4", "w8a8", "gguf")
# fused projection -> its parts, in output order
FUSED_PROJECTIONS: dict[str, tuple[str, ...]] = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}

# the output head's backend where it differs from the projections': int4 models keep an int8 head (as
# llama.cpp's Q4_K_M files keep a 6-bit one): the head decides the argmax, and int4 groups cost it
# ~4% of its largest weight (SmolLM2), int8 channels ~0.4%
HEAD_BACKENDS: dict[str, str] = {"int4": "int8"}


# a draft model's head where it differs from its target-style one: drafts never have to be exact (the
# target verifies every token), and an int4 head runs in about half the int8 one's time for a few
# argmax flips against the float head (tools/quantised_checks.py kernels, heads)
DRAFT_HEAD_BACKENDS: dict[str, str] = {"int4": "int4"}


def head_backend(backend: str, draft: bool = False) -> str:
    """The output head's backend for a model whose projections run ``backend`` (as a draft: its
    draft head)."""
    if draft and backend in DRAFT_HEAD_BACKENDS:
        return DRAFT_HEAD_BACKENDS[backend]
    return HEAD_BACKENDS.get(backend, backend)


def make_linear(
    backend: str, weight: torch.Tensor, bias: torch.Tensor | None, width: int = 1, source: Any = None
) -> Linear:
    """``source``: weights already quantised for ``backend`` (int4 or GGUF blocks from a GGUF file), else None."""
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"unknown linear backend '{backend}'; known: {', '.join(LINEAR_BACKENDS)}")
    if not BACKEND_AVAILABLE[backend]():
        raise RuntimeError(f"linear backend '{backend}' is not available in this torch build/device")
    return LINEAR_BACKENDS[backend](weight, bias, width, source)
