"""int4 weights read from a GGUF file's own blocks, cached beside the float32 safetensors cache.

GGUF's 4-bit formats are affine over 32-element (sub-)blocks, which the int4 layout of
``runtime.quant`` (``w = (q - 8) * scale + zero``, groups of 32) holds with the same ``q``; only the
scale and zero are rounded to bf16:

- ``Q4_1`` (block of 32): ``w = d * q + m``: scale ``d``, zero ``m + 8 d``;
- ``Q4_K`` (super-block of 256 = 8 sub-blocks of 32, 6-bit sub-scales and mins):
  ``w = d * sc_j * q - dmin * m_j``: scale ``d sc_j``, zero ``8 d sc_j - dmin m_j``.

Every other projection (Q5_0, Q6_K, Q8_0 tensors, or a model without a GGUF file) is quantised from
its dequantised float32 weights (``quantise_int4``). The result for every projection and the head is
written once to ``int4-g32.safetensors`` in the model's cache directory; later loads read it back.
The output head is not among them: int4 models keep an int8 head (``runtime.linear.HEAD_BACKENDS``).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runtime.quant import INT4_GROUP, Int4Weights, int4_fits, quantise_int4

log = logging.getLogger(__name__)

CACHE_FILE = "int4-g32.safetensors"
# GGUF tensor name part -> the HF module path inside a decoder layer
LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)[..., 0]


def q4_1(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[N, bytes] Q4_1 rows -> (q [N, K] 0..15, scale, zero [N, K / 32])."""
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, 20)
    d, m = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    qs = blocks[..., 4:20]
    q = np.concatenate([qs & 0xF, qs >> 4], axis=-1)  # elements 0..15 low nibbles, 16..31 high
    return q.reshape(n, -1), d, m + 8 * d


def q4_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[N, bytes] Q4_K rows -> (q [N, K] 0..15, scale, zero [N, K / 32])."""
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, 144)
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    s = blocks[..., 4:16].astype(np.int32)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    qs = blocks[..., 16:144].reshape(n, -1, 4, 32)
    q = np.stack([qs & 0xF, qs >> 4], axis=3)  # chunk i: sub-block 2i low nibbles, 2i+1 high
    scale = d[..., None] * sc
    zero = 8 * scale - dmin[..., None] * mn
    return q.reshape(n, -1), scale.reshape(n, -1), zero.reshape(n, -1)


DECODERS = {"Q4_1": q4_1, "Q4_K": q4_k}


def llama_rows(n: int, heads: int) -> np.ndarray:
    """The row order Hugging Face's GGUF loader gives llama q/k projections (it undoes the
    rotary interleave llama.cpp's converter applied)."""
    dim = n // heads // 2
    return np.arange(n).reshape(heads, dim, 2).swapaxes(2, 1).reshape(n)


def read_gguf_int4(path: Path, config: Any) -> dict[str, Int4Weights]:
    """The projections stored as Q4_1 / Q4_K in ``path``, by HF parameter prefix
    (``model.layers.3.mlp.up_proj``), in the HF module's row order."""
    import gguf

    from runtime.gguf_file import read_index

    out: dict[str, Int4Weights] = {}
    for t in read_index(path).tensors:
        parts = t.name.split(".")
        kind = gguf.GGMLQuantizationType(t.tensor_type).name
        if len(parts) != 4 or parts[0] != "blk" or parts[2] not in LAYER_TENSORS or kind not in DECODERS:
            continue
        q, scale, zero = DECODERS[kind](np.asarray(t.data))
        if config.model_type == "llama" and parts[2] in ("attn_q", "attn_k"):
            heads = config.num_attention_heads if parts[2] == "attn_q" else config.num_key_value_heads
            rows = llama_rows(q.shape[0], heads)
            q, scale, zero = q[rows], scale[rows], zero[rows]
        out[f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}"] = Int4Weights(
            torch.from_numpy(np.ascontiguousarray(q, dtype=np.uint8)),
            torch.from_numpy(scale).to(torch.bfloat16), torch.from_numpy(zero).to(torch.bfloat16), INT4_GROUP,
        )
    return out


def _linears(hf_model: Any) -> dict[str, Any]:
    return {name: mod for name, mod in hf_model.named_modules() if isinstance(mod, torch.nn.Linear)}


def _save(weights: dict[str, Int4Weights], path: Path) -> None:
    from safetensors.torch import save_file

    tensors = {}
    for name, w in weights.items():
        tensors[f"{name}.q"] = (w.q[:, 0::2] | (w.q[:, 1::2] << 4)).contiguous()  # two per byte
        tensors[f"{name}.scale"], tensors[f"{name}.zero"] = w.scale.contiguous(), w.zero.contiguous()
    tmp = path.with_suffix(".partial")
    save_file(tensors, str(tmp))
    tmp.rename(path)


def _load(path: Path) -> dict[str, Int4Weights]:
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    out = {}
    for key in tensors:
        if key.endswith(".q"):
            name, packed = key[:-2], tensors[key]
            q = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
            out[name] = Int4Weights(q, tensors[f"{name}.scale"], tensors[f"{name}.zero"], INT4_GROUP)
    return out


def int4_weights(hf_model: Any, cache_dir: Path | None, gguf_path: Any = None) -> dict[str, Int4Weights]:
    """int4 weights of every linear the kernel can hold: read from ``cache_dir`` when cached;
    else from the GGUF blocks where they are 4-bit and from the float weights elsewhere, then
    cached. ``gguf_path``: a path, or a callable giving one (only called when not cached)."""
    cached = cache_dir / CACHE_FILE if cache_dir is not None else None
    if cached is not None and cached.exists():
        return _load(cached)
    path = gguf_path() if callable(gguf_path) else gguf_path
    from_gguf = read_gguf_int4(Path(path), hf_model.config) if path is not None else {}
    out = {}
    for name, mod in _linears(hf_model).items():
        if name != "lm_head" and int4_fits(mod.weight):  # the head runs int8 (runtime.linear.HEAD_BACKENDS)
            out[name] = from_gguf.get(name) or quantise_int4(mod.weight)
    log.info("int4 weights: %d of %d linears from the GGUF's own blocks", len(from_gguf), len(out))
    if cached is not None:
        _save(out, cached)
    return out


def attach(hf_model: Any, weights: dict[str, Int4Weights]) -> None:
    """Give each linear its int4 weights (``runtime.transformer`` passes them to the backend)."""
    for name, mod in _linears(hf_model).items():
        if name in weights:
            mod.int4_weights = weights[name]
