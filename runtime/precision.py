"""Precisions: what arithmetic a model runs in. One registry for targets and drafts, one place for
the defaults.

A precision fixes the dtype of the module tree (embeddings, norms, attention, the KV cache) and the
linear backend of every projection and the head (``runtime.linear``). The quantised ones keep the
tree in float32 and run the projections on torch's CPU kernels, whose rows are invariant to the
number of rows in a call (``runtime.quant``): every width of a model, plain steps and verifies, is
computed by one kernel family, so speculative greedy output equals plain greedy output *at that
precision*. ``float32`` on the CPU runs oneDNN's float32 GEMMs, row-invariant too
(``runtime.linear.float32_cpu_backend``); with ``AUTOTUNE_FLOAT32_KERNEL=dense``, and off the CPU, it is
identical to Hugging Face's float32 forward. The others never are.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from runtime.auto_precision import cpu_auto_precision
from runtime.errors import RuntimeUserError
from runtime.kernels import KernelsUnavailable
from runtime.kernels import load as load_ggml_kernels
from runtime.linear import float32_cpu_backend


@dataclass(frozen=True)
class Precision:
    name: str
    load_dtype: torch.dtype  # the module tree (embeddings, norms, attention, KV cache)
    backend: str  # the linear backend of every projection and the head, every width
    devices: tuple[str, ...] | None = None  # device kinds with a kernel (None: any)
    summary: str = ""
    # the backend reads nothing but a GGUF file's blocks: a packaged model loads without float weights
    # (``runtime.loading.loads_blocks_only``)
    blocks_only: bool = False

    @property
    def quantised(self) -> bool:
        return self.backend != "dense"

    def backend_on(self, device: str | torch.device, compiled: bool = False) -> str:
        """The linear backend a target at this precision runs at every width on ``device``: its
        own, except float32 on the CPU uncompiled, which runs ``runtime.linear.float32_cpu_backend``
        (oneDNN's row-invariant GEMMs unless ``AUTOTUNE_FLOAT32_KERNEL`` pins dense)."""
        if self.backend == "dense" and self.load_dtype == torch.float32 and not compiled \
                and torch.device(device).type == "cpu":
            return float32_cpu_backend()
        return self.backend


PRECISIONS: dict[str, Precision] = {
    "float32": Precision("float32", torch.float32, "dense", summary="float32 arithmetic (CPU: oneDNN GEMMs; AUTOTUNE_FLOAT32_KERNEL=dense: Hugging Face's own)"),
    "bfloat16": Precision("bfloat16", torch.bfloat16, "dense", summary="bf16 weights and activations"),
    "float16": Precision("float16", torch.float16, "dense", summary="fp16 weights and activations"),
    "int8": Precision("int8", torch.float32, "int8", ("cpu",), "int8 weights per channel, bf16 activations"),
    "int4": Precision("int4", torch.float32, "int4", ("cpu",), "int4 weights in groups of 32, bf16 activations"),
    "w8a8": Precision("w8a8", torch.float32, "w8a8", ("cpu",), "int8 weights, int8 activations per token"),
    "gguf": Precision("gguf", torch.float32, "gguf", ("cpu",),
                      "the GGUF file's own blocks on ggml's CPU kernels (llama.cpp's), activations quantised per row",
                      blocks_only=True),
}
ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
AUTO = "auto"
# ``auto`` per device kind: the fastest precision that is exact relative to itself for speculative
# decoding; on the CPU int4 or w8a8, measured once per machine (``runtime.auto_precision``), bf16
# where the GPU's kernels are fast
AUTO_PRECISION: dict[str, str | Callable[[], str]] = {
    "cpu": cpu_auto_precision, "cuda": "bfloat16", "xpu": "bfloat16", "mps": "bfloat16",
}


def cpu_auto_draft_precision() -> str:
    """Drafts never have to be exact: gguf where ``auto`` measured its kernels fastest on this CPU
    (ggml's one-row dot products, a draft's step), else int4 (torch's weight-only kernel)."""
    return "gguf" if cpu_auto_precision() == "gguf" else "int4"


# drafts never have to be exact: ``auto`` picks the fastest draft step measured per device kind
AUTO_DRAFT_PRECISION: dict[str, str | Callable[[], str]] = {
    "cpu": cpu_auto_draft_precision, "cuda": "bfloat16", "mps": "bfloat16",
}
DEFAULT_PRECISION = "float32"  # the library default: float32 arithmetic (runtime.linear.float32_cpu_backend)


def auto_precision(kind: str) -> str:
    """What ``auto`` means on device kind ``kind`` (measured on the CPU: the first call may probe)."""
    chosen = AUTO_PRECISION[kind]
    return chosen if isinstance(chosen, str) else chosen()


def precision_names() -> str:
    return ", ".join([*PRECISIONS, AUTO])


def get_precision(name: str, device: str | torch.device, compiled: bool = False, what: str = "--precision") -> Precision:
    """A precision name (or alias, or ``auto``) -> the ``Precision`` the device runs; anything the
    device cannot run is one clear error here, before any model loads."""
    kind = torch.device(device).type
    if name == AUTO:
        if kind not in AUTO_PRECISION:
            raise RuntimeUserError(f"no automatic precision for device '{device}'; pass {what} float32 or bfloat16")
        if compiled and not isinstance(AUTO_PRECISION[kind], str):  # the CPU's measured choice is quantised
            name = "float32"  # either way: nothing to probe
        else:
            name = auto_precision(kind)
            if compiled and PRECISIONS[name].backend != "dense":
                name = "float32"
    name = ALIASES.get(name, name)
    if name not in PRECISIONS:
        raise RuntimeUserError(f"unknown precision '{name}' for {what}; choose one of {precision_names()}")
    p = PRECISIONS[name]
    if p.devices is not None and kind not in p.devices:
        raise RuntimeUserError(
            f"{what} {name} has no backend on '{kind}' here (it runs torch's {', '.join(p.devices)} kernels); "
            f"use {what} bfloat16 or auto on {kind}"
        )
    if p.backend == "gguf":
        try:
            load_ggml_kernels()
        except KernelsUnavailable as exc:
            raise RuntimeUserError(f"{what} gguf: {exc}") from exc
    if compiled and p.backend != "dense":
        raise RuntimeUserError(
            f"{what} {name} cannot be compiled (its GEMMs are opaque to torch.compile); "
            f"use {what} float32 or bfloat16 with --compile"
        )
    return p


def draft_precision(name: str, device: str | torch.device, compiled: bool = False) -> Precision:
    """A strategy's ``draft_precision`` -> the draft's ``Precision`` (``auto``: the measured fastest
    draft step for the device kind; compiled: the device's float type)."""
    kind = torch.device(device).type
    if name == AUTO:
        if kind not in AUTO_DRAFT_PRECISION:
            raise RuntimeUserError(f"no automatic draft precision for device '{device}'; pass --draft-precision")
        chosen = AUTO_DRAFT_PRECISION[kind]
        if compiled and not isinstance(chosen, str):  # the CPU's measured choice is quantised: nothing to probe
            return PRECISIONS["float32"]
        auto = PRECISIONS[chosen if isinstance(chosen, str) else chosen()]
        return PRECISIONS["float32"] if compiled and auto.backend != "dense" else auto
    return get_precision(name, device, compiled, what="--draft-precision")
