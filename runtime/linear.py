"""Linear-layer backends: how a projection ``y = x W^T + b`` is executed.

- ``dense``: ``F.linear`` on the model's own weights (exact; plain decoding is bit-identical to HF).
- ``mkl-packed``: float32 weights repacked by MKL for one batch width ``M``; a GEMM with exactly ``M``
  rows then costs about as much as one row on CPU (used for the target's verify pass, whose width
  is fixed by the strategy). Other widths fall back to ``F.linear`` on the original weights.
- ``int8``: dynamic int8 (per-output-channel weights, fbgemm) for drafts only: a draft never has to
  be exact, the target verifies every token.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F


class Linear(Protocol):
    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...  # [T, in] -> [T, out]


class DenseLinear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MklPackedLinear:
    """float32 GEMM with weights prepacked for exactly ``width`` rows (CPU builds with MKL)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, width: int) -> None:
        self.weight, self.bias, self.width = weight, bias, width
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), width)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] != self.width:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkl._mkl_linear(x, self.packed, self.weight, self.bias, self.width)


class Int8DynamicLinear:
    """Per-channel int8 weights, activations quantised on the fly (fbgemm); approximate."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        from torch.ao.nn.quantized.dynamic import Linear as QLinear

        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-8)
        with warnings.catch_warnings():  # torch marks quantized tensors deprecated; pinned torch has them
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch.quantize_per_channel(
                w, scale.double(), torch.zeros_like(scale, dtype=torch.long), axis=0, dtype=torch.qint8
            )
        self.module = QLinear(w.shape[1], w.shape[0], bias_=bias is not None, dtype=torch.qint8)
        self.module.set_weight_bias(qweight, None if bias is None else bias.detach().float())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x.float())


def mkl_packing_available() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def int8_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


LinearFactory = Callable[[torch.Tensor, "torch.Tensor | None", int], Linear]

LINEAR_BACKENDS: dict[str, LinearFactory] = {
    "dense": lambda w, b, width: DenseLinear(w, b),
    "mkl-packed": lambda w, b, width: MklPackedLinear(w, b, width),
    "int8": lambda w, b, width: Int8DynamicLinear(w, b),
}

BACKEND_AVAILABLE: dict[str, Callable[[], bool]] = {
    "dense": lambda: True,
    "mkl-packed": mkl_packing_available,
    "int8": int8_available,
}


def make_linear(backend: str, weight: torch.Tensor, bias: torch.Tensor | None, width: int = 1) -> Linear:
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"unknown linear backend '{backend}'; known: {', '.join(LINEAR_BACKENDS)}")
    if not BACKEND_AVAILABLE[backend]():
        raise RuntimeError(f"linear backend '{backend}' is not available in this torch build/device")
    return LINEAR_BACKENDS[backend](weight, bias, width)
