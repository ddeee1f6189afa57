"""What of a Llama / Qwen2 layer the ggml extension's row kernels compute (``runtime.kernels``):
RMSNorm modules, SiLU MLPs, and whole layers at gguf (``CausalLM.fused_layers``)."""
from __future__ import annotations

from typing import Any

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
