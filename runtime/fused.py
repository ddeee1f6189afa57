"""The ggml extension's row kernels (``runtime.kernels``) as a Llama / Qwen2 model runs them at gguf:
RMSNorm, RoPE and attention by rows, and whole layers in one call (``RowKernels``, which
``runtime.transformer.CausalLM`` mixes in)."""
from __future__ import annotations

from typing import Any

import torch

from runtime.attention import apply_rope
from runtime.linear import ROW_ATTENTION_BACKENDS

# RMSNorm modules the extension's kernel computes (w * x / sqrt(mean(x^2) + eps), ``variance_epsilon``)
KERNEL_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm")
# activation modules that compute SiLU (torch's, and transformers' ACT2FN["silu"])
SILU_MODULES = ("SiLU", "SiLUActivation")


def silu_mlp(layer: Any) -> bool:
    """Whether ``layer``'s MLP activation is SiLU."""
    return type(getattr(layer.mlp, "act_fn", None)).__name__ in SILU_MODULES


def fusable(layer: Any, lin: dict[str, Any]) -> tuple[Any, ...] | None:
    """``layer``'s arguments to ``kernels.layer`` before its cache views, or None where it cannot run
    as one call (``CausalLM.fused_layers``)."""
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    parts = [lin.get(name) for name in ("qkv", "o", "gate_up", "down")]
    if (not silu_mlp(layer) or not all(kernel_norm(n) for n in norms)
            or not all(getattr(p, "kind", None) == "gguf" for p in parts)
            or parts[2].bias is not None or parts[3].bias is not None):
        return None
    qkv, o, gate_up, down = parts
    return (norms[0].weight, norms[0].variance_epsilon, qkv.segments, qkv.types, qkv.bias, o.segments, o.types,
            o.bias, norms[1].weight, norms[1].variance_epsilon, gate_up.segments, gate_up.types,
            down.segments, down.types)


def kernel_norm(norm: Any) -> bool:
    """Whether the extension's RMSNorm computes ``norm``."""
    return type(norm).__name__ in KERNEL_NORMS


class RowKernels:
    """How a model uses the extension's row kernels: where its rows attend by ``attention.attend_rows``
    (``row_attention``), its norms and RoPE run there too, and a layer loop without plans runs each
    layer as one call (``fused_layers``, ``run_fused``)."""

    backend: str
    dtype: torch.dtype
    layers: list[Any]
    linears: list[dict[str, Any]]
    dims: Any
    scale: float
    _fused: list[tuple[Any, ...]] | None

    @property
    def row_attention(self) -> bool:
        """Whether rows attend through the extension's row-by-row kernel (``attention.attend_rows``)
        rather than padded SDPA calls (``attention.sdpa_invariant``)."""
        return self.backend in ROW_ATTENTION_BACKENDS and self.dtype == torch.float32

    @property
    def kernels(self) -> Any:
        from runtime.kernels import load

        return load()

    def normed(self, norm: Any, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, H]`` through ``norm``, one of this model's RMSNorm modules: by the extension's
        kernel where rows attend through it (the same formula, each row's sum of squares in a fixed
        order), else by the module itself."""
        if self.row_attention and kernel_norm(norm):
            return self.kernels.rms_norm(x, norm.weight, norm.variance_epsilon)
        return norm(x)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``attention.apply_rope``, by the extension where rows attend through it (the same products
        and sums, one call)."""
        return self.kernels.rope(x, cos, sin) if self.row_attention else apply_rope(x, cos, sin)

    def fused_layers(self) -> list[tuple[Any, ...]] | None:
        """Per layer, the weights the extension's whole-layer call (``kernels.layer``) runs, where every
        layer can run as one (``fusable``). That call composes the very functions the per-op layer
        loop calls, in the same order: the same bits, one call per layer."""
        if self._fused is None:  # decided once per set of linears: [] where some layer cannot run as one call
            layers = [fusable(layer, lin) for layer, lin in zip(self.layers, self.linears)] if self.row_attention else []
            self._fused = layers if layers and all(f is not None for f in layers) else []
        return self._fused or None

    def run_fused(self, fused: list[tuple[Any, ...]], h: torch.Tensor, a: Any) -> torch.Tensor:
        """Every layer over rows ``h`` ``[T, E]``, one extension call each, under ``a``
        (``layer_exec.AttnInputs``: the cache, the slots written, masks, RoPE) -> the last layer's output."""
        for li, weights in enumerate(fused):
            layer_mask, _ = a.mask_for(li)
            h = self.kernels.layer(h, *weights, a.cache.all_keys[li], a.cache.all_values[li], a.slots, layer_mask,
                                   a.cos, a.sin, self.dims.n_heads, self.scale)
        return h
