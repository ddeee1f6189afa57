"""A packaged GGUF model at the ``gguf`` precision, built from the file alone, never in float32.

The module tree is made with its parameters on the meta device (accelerate's ``init_empty_weights``:
no storage); every projection and the head keep the file's memory-mapped blocks
(``runtime.gguf_blocks``); the token embedding dequantises only the rows a forward looks up
(``GgufEmbedding``); the few float tensors (norms, biases) are read from the file. The process
therefore holds about the file's size, and no float32 tree is ever made. The linears' float
weights stay on the meta device: only the ``gguf`` backend runs such a tree
(``runtime.pipeline.ModelPool`` keeps it apart from the float trees other precisions read), and
anything else that reaches for a float weight fails on the meta tensor rather than computing on
made-up values.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from runtime.errors import RuntimeUserError
from runtime.gguf_blocks import GgufWeights, attach, blocks_from_index
from runtime.gguf_file import read_index
from runtime.gguf_int4 import llama_rows

# the file's float tensors inside a layer (``blk.N.<name>``) -> the HF module path inside the layer
LAYER_FLOATS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
}
MODEL_FLOATS = {"output_norm.weight": "model.norm.weight"}
EMBEDDING = "token_embd.weight"


class GgufEmbedding(torch.nn.Module):
    """The token embedding as the file's blocks: a lookup dequantises just the rows it asks for
    (ggml's ``to_float``, the values llama.cpp's own lookup gives)."""

    def __init__(self, blocks: GgufWeights) -> None:
        super().__init__()
        from runtime.kernels import load

        if len(blocks.segments) != 1:
            raise ValueError("an embedding is one block matrix")
        (self.data, self.type), = blocks.segments
        self.k = blocks.k
        self.num_embeddings = self.data.shape[0]
        self.ops = load()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.data.index_select(0, ids.reshape(-1).to(torch.long))
        return self.ops.dequantize(rows, self.type, self.k).reshape(*ids.shape, self.k)


def _float_tensor(t: Any, config: Any, name: str) -> torch.Tensor:
    """A float tensor of the file (F32 or F16) as float32, in the HF module's row order."""
    data = torch.from_numpy(np.asarray(t.data).astype(np.float32, copy=True)).reshape(-1)
    if config.model_type == "llama" and name in ("attn_q.bias", "attn_k.bias"):
        heads = config.num_attention_heads if name == "attn_q.bias" else config.num_key_value_heads
        data = data[torch.from_numpy(llama_rows(data.shape[0], heads))]
    return data


def load_blocks_only(path: Path, config: Any) -> Any:
    """The HF module tree of ``config`` over the GGUF file at ``path``: projections and head as the
    file's blocks, embedding as ``GgufEmbedding``, norms and biases read; nothing else materialised.
    A projection the file has no blocks for is refused (its float weight does not exist here)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM, GenerationConfig

    index = read_index(path)
    with init_empty_weights():  # parameters on meta; buffers (RoPE's inverse frequencies) real
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    model.generation_config = GenerationConfig.from_model_config(config)
    blocks, embedding = blocks_from_index(index, config)
    if embedding is None:
        raise RuntimeUserError(f"{path.name} has no {EMBEDDING}; load it with --precision float32")
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    missing = sorted(linears - set(blocks))
    if missing:
        raise RuntimeUserError(
            f"{path.name} holds no blocks for {missing[0]} ({len(missing)} projections); "
            "load it with --precision float32, int4 or w8a8")
    attach(model, blocks)
    floats = {}
    for t in index.tensors:
        parts = t.name.split(".", 2)
        if t.name in MODEL_FLOATS:
            floats[MODEL_FLOATS[t.name]] = _float_tensor(t, config, t.name)
        elif parts[0] == "blk" and len(parts) == 3 and parts[2] in LAYER_FLOATS:
            floats[f"model.layers.{parts[1]}.{LAYER_FLOATS[parts[2]]}"] = _float_tensor(t, config, parts[2])
    params = dict(model.named_parameters())
    for name, value in floats.items():
        if name not in params:
            raise RuntimeUserError(f"{path.name} holds {name}, which a {config.model_type} model has no place for")
        module, attr = model.get_submodule(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1]
        setattr(module, attr, torch.nn.Parameter(value.view(params[name].shape), requires_grad=False))
    model.model.embed_tokens = GgufEmbedding(embedding)
    left = [n for n, p in model.named_parameters()
            if p.is_meta and not (n.endswith(".weight") and n.rsplit(".", 1)[0] in linears)]
    if left:
        raise RuntimeUserError(f"{path.name} has no {left[0]} ({len(left)} tensors missing); the file is incomplete")
    model.blocks_only = True
    model.gguf_attached = True
    return model
