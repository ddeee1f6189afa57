"""Quantised linear backends on torch's own CPU kernels (no extra library).

Every backend here is **row-invariant**: a row's result is bit-identical whatever the number of rows
in the call, so a width-k verify and a width-1 plain step of the same model agree exactly, and
speculative decoding at a quantised precision is lossless relative to plain decoding at it.

- ``int8``: weight-only, int8 per output channel (bf16 scale), bf16 activations
  (``aten._weight_int8pack_mm``).
- ``int4``: weight-only, affine int4 over groups of 32 input elements (bf16 scale and zero per
  group), bf16 activations (``aten._weight_int4pack_mm_for_cpu``). The layout is
  ``w = (q - 8) * scale + zero`` with ``q`` in 0..15: GGUF's Q4_0/Q4_1/Q4_K blocks map onto it.
  A matrix whose shape the kernel cannot hold (output rows not a multiple of 16) runs ``int8``.
- ``w8a8``: int8 weights per output channel and int8 activations with one scale per row (per token),
  integer accumulation (oneDNN's int8 linear on pre-packed weights, else ``torch._int_mm``: the
  same numbers); its cost grows little with the rows.
- ``int8-dynamic``: fbgemm's dynamic int8 (one activation scale per call, so *not* row-invariant):
  kept for drafts only, which never have to be exact.

Inputs and outputs are in the model's float dtype (float32 here); the cast to bf16 and back, and
the bias, are row-wise.
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch

INT4_GROUP = 32  # GGUF's (sub-)block size
INT4_ROW_MULTIPLE = 16  # the CPU kernel packs output rows in tiles of 16


@dataclass(frozen=True)
class Int4Weights:
    """Affine int4 weights ``w = (q - 8) * scale + zero`` over groups of ``group`` inputs."""

    q: torch.Tensor  # [N, K] uint8, values 0..15
    scale: torch.Tensor  # [N, K // group] bfloat16
    zero: torch.Tensor  # [N, K // group] bfloat16
    group: int = INT4_GROUP

    def rows(self, n: int) -> "Int4Weights":
        """The first ``n`` output rows (a restricted head)."""
        return Int4Weights(self.q[:n].contiguous(), self.scale[:n].contiguous(), self.zero[:n].contiguous(), self.group)

    @staticmethod
    def cat(parts: "list[Int4Weights]") -> "Int4Weights":
        """Several matrices' weights stacked along the output rows (one fused projection)."""
        if len({p.group for p in parts}) != 1:
            raise ValueError("int4 weights of different group sizes cannot be stacked")
        return Int4Weights(
            torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), torch.cat([p.zero for p in parts]),
            parts[0].group,
        )

    def dequantise(self) -> torch.Tensor:
        n, k = self.q.shape
        q = self.q.view(n, k // self.group, self.group).float() - 8
        return (q * self.scale.float()[..., None] + self.zero.float()[..., None]).view(n, k)


def int4_fits(weight: torch.Tensor, group: int = INT4_GROUP) -> bool:
    n, k = weight.shape
    return n % INT4_ROW_MULTIPLE == 0 and k % group == 0


def quantise_int4(weight: torch.Tensor, group: int = INT4_GROUP) -> Int4Weights:
    """Min/max affine int4 per group, the scale and zero rounded to bf16 before ``q`` is chosen."""
    n, k = weight.shape
    w = weight.detach().float().view(n, k // group, group)
    lo, hi = w.amin(-1), w.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8).to(torch.bfloat16)
    zero = (lo + 8 * scale.float()).to(torch.bfloat16)
    q = torch.round((w - zero.float()[..., None]) / scale.float()[..., None] + 8).clamp(0, 15)
    return Int4Weights(q.view(n, k).to(torch.uint8), scale, zero, group)


def quantise_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel: (q [N, K] int8, scale [N] float32, a bf16 value)."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-8).to(torch.bfloat16).float()
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale


class _Affine:
    """The float side shared by the quantised linears: output dtype and bias."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_dtype = weight.dtype if weight.is_floating_point() else torch.float32
        self.bias = None if bias is None else bias.detach().to(self.out_dtype)

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        y = y.to(self.out_dtype)
        return y if self.bias is None else y + self.bias


class Int8WeightOnlyLinear(_Affine):
    kind = "int8"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(weight, bias)
        self.q, scale = quantise_int8(weight)
        self.scale = scale.to(torch.bfloat16)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.finish(torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.q, self.scale))


class Int4WeightOnlyLinear(_Affine):
    kind = "int4"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, int4: Int4Weights | None = None) -> None:
        super().__init__(weight, bias)
        int4 = int4 if int4 is not None else quantise_int4(weight)
        self.group = int4.group
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(int4.q.to(torch.int32), 1)
        # the kernel's layout: [K // group, N, 2] (scale, zero)
        self.scale_zero = torch.stack([int4.scale.t(), int4.zero.t()], dim=-1).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, self.group, self.scale_zero)
        return self.finish(y)


class W8A8Linear(_Affine):
    """int8 weights per output channel, int8 activations per row, integer accumulation; the
    int32 sums scaled by the weight scale, then by the row's activation scale (``(acc * w) * a``,
    each product rounded once, whatever the kernel).

    The kernel is oneDNN's int8 linear over weights packed once at load (``onednn.qlinear_prepack``;
    activations offset by 128 to unsigned, zero point 128: the same integers): ``torch._int_mm``
    re-lays the weights out in every call with more than one row, so a 16-row call cost 4x one row
    on an AMD EPYC against 2x packed (8960x1536 x 24). Without oneDNN, ``torch._int_mm`` computes
    the same numbers."""

    kind = "w8a8"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(weight, bias)
        q, self.w_scale = quantise_int8(weight)
        if onednn_int8_available():
            self.packed: torch.Tensor | None = torch.ops.onednn.qlinear_prepack(q, None)
            self.w_zero = torch.zeros(q.shape[0], dtype=torch.int64)
            self.q_t = None
        else:
            self.packed = None
            self.q_t = q.t()  # [K, N]; _int_mm reads the transposed view as is

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        a_scale = (xf.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-8)
        xq = torch.round(xf / a_scale).clamp(-127, 127)
        if self.packed is not None:
            y = torch.ops.onednn.qlinear_pointwise(
                (xq + 128).to(torch.uint8), 1.0, 128, self.packed, self.w_scale, self.w_zero, None, 1.0, 0,
                torch.float32, "none", [], "")  # exact int32 sums, times the weight scale
        else:
            y = torch._int_mm(xq.to(torch.int8), self.q_t).float() * self.w_scale
        return self.finish(y * a_scale)


class Bf16Linear(_Affine):
    """bfloat16 weights and activations, float in and out: a weight-only model's prefill, whose many
    rows the int4 and int8 kernels run compute-bound (``tools/quantised_checks.py timings``)."""

    kind = "bf16"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(weight, bias)
        self.weight = weight.detach().to(torch.bfloat16)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.finish(torch.nn.functional.linear(x.to(torch.bfloat16), self.weight))


class Int8DynamicLinear:
    """Per-channel int8 weights, activations quantised on the fly per call (fbgemm); approximate."""

    kind = "int8-dynamic"

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


def int4_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, int4: Int4Weights | None = None
) -> "Int4WeightOnlyLinear | Int8WeightOnlyLinear":
    """int4 where the kernel holds the shape, else int8 weight-only (both row-invariant)."""
    if int4_fits(weight) and (int4 is None or int4_fits(int4.q)):
        return Int4WeightOnlyLinear(weight, bias, int4)
    return Int8WeightOnlyLinear(weight, bias)


def weight_only_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int8pack_mm") and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def int_mm_available() -> bool:
    return hasattr(torch, "_int_mm")


@functools.cache
def onednn_int8_available() -> bool:
    """oneDNN's int8 linear over pre-packed weights (``W8A8Linear``'s kernel where present and
    exact): on CPUs without VNNI its u8 x s8 products are summed in pairs into int16, which
    saturates, so it is used only where it computes ``torch._int_mm``'s exact sums (checked once on
    the largest products, whose pairs overflow int16)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_prepack")):
        return False
    k = 64
    q = torch.full((16, k), 127, dtype=torch.int8)
    x = torch.full((1, k), 127.0)
    packed = torch.ops.onednn.qlinear_prepack(q, None)
    got = torch.ops.onednn.qlinear_pointwise(
        (x + 128).to(torch.uint8), 1.0, 128, packed, torch.ones(16), torch.zeros(16, dtype=torch.int64), None, 1.0, 0,
        torch.float32, "none", [], "")
    return bool(torch.equal(got, torch._int_mm(x.to(torch.int8).expand(17, k).contiguous(), q.t())[:1].float()))


def fbgemm_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines
