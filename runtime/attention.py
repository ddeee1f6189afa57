"""Attention pieces shared by the plain layer loop (``runtime.transformer``) and the layer-plan
executor (``runtime.layer_exec``): RoPE tables, masks (causal, sliding window) and grouped-query
SDPA. Shapes: batch 1, ``q`` ``[H, T, D]``, keys/values ``[Hkv, S, D]``, masks ``[T, S]`` bool
(True = attend).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from runtime.errors import RuntimeUserError

Windows = tuple[int | None, ...]  # per layer: its sliding attention window, or None (full attention)


def no_windows(cfg: Any) -> Windows:
    """Llama: every layer attends to the whole prefix (``config.sliding_window`` is not read)."""
    return (None,) * cfg.num_hidden_layers


def mistral_windows(cfg: Any) -> Windows:
    """Mistral: every layer uses ``config.sliding_window`` when it is set (HF ``modeling_mistral``:
    ``create_sliding_window_causal_mask`` for all layers; ``config.layer_types`` is ignored)."""
    return (getattr(cfg, "sliding_window", None),) * cfg.num_hidden_layers


def layer_type_windows(cfg: Any) -> Windows:
    """Qwen2: layers whose ``config.layer_types[i]`` is ``"sliding_attention"`` use
    ``config.sliding_window`` (set only when ``use_sliding_window``; by default the layers from
    ``max_window_layers`` on are the sliding ones; HF ``Qwen2Attention.sliding_window``)."""
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None)
    return tuple(window if kind == "sliding_attention" else None for kind in types)


# RoPE variants whose frequencies HF recomputes from the sequence length during the forward
# (``modeling_rope_utils.dynamic_rope_update``): a precomputed table cannot follow them.
LENGTH_DEPENDENT_ROPE: dict[str, str] = {
    "dynamic": "set its rope_type to \"default\" in config.json: HF's dynamic RoPE equals plain RoPE "
    "up to max_position_embeddings={max_pos} tokens, as far as we decode",
    "longrope": "it switches from short_factor to long_factor past original_max_position_embeddings; "
    "use a checkpoint with static RoPE (default, linear, llama3 or yarn)",
}


def check_rope(cfg: Any, rotary: Any) -> None:
    """Refuse RoPE types our fixed table would silently get wrong."""
    rope_type = getattr(rotary, "rope_type", "default")
    advice = LENGTH_DEPENDENT_ROPE.get(rope_type)
    if advice is not None:
        raise RuntimeUserError(
            f"rope_scaling.rope_type='{rope_type}' (config.rope_parameters in transformers 5) is not supported: "
            f"its RoPE frequencies change with the sequence length; "
            + advice.format(max_pos=cfg.max_position_embeddings)
        )


class RotaryTable:
    """cos/sin tables for positions ``[0, capacity)`` (``[P, D]`` each), built at load for the
    first ``PRECOMPUTED_POSITIONS`` and regrown (doubling) only when a cache needs more."""

    PRECOMPUTED_POSITIONS = 4096

    def __init__(self, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype, device: torch.device | str = "cpu",
                 positions: int = 0) -> None:
        self.inv_freq = inv_freq.detach().float().cpu()
        self.scaling = scaling
        self.dtype = dtype
        self.cos = torch.empty(0)
        self.sin = torch.empty(0)
        if positions:
            self.ensure(positions, torch.device(device))

    def ensure(self, capacity: int, device: torch.device) -> None:
        if self.cos.shape[0] >= capacity:
            return
        # normal tensors even when first needed under inference mode: a compiled step guards on it
        with torch.inference_mode(False), torch.no_grad():
            pos = torch.arange(max(capacity, 2 * self.cos.shape[0]), dtype=torch.float32)
            freqs = torch.outer(pos, self.inv_freq)  # [P, D/2]
            emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
            self.cos = (emb.cos() * self.scaling).to(device=device, dtype=self.dtype)
            self.sin = (emb.sin() * self.scaling).to(device=device, dtype=self.dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions], self.sin[positions]  # [T, D] each


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[H, T, D]``; cos/sin ``[T, D]``."""
    return x * cos + _rotate_half(x) * sin


def attend_mask(slots: torch.Tensor, n_keys: int, rel_mask: torch.Tensor | None) -> torch.Tensor:
    """``[T, n_keys]`` bool: which cache slots each of a forward's rows attends to, built on the
    device from static shapes (no host read; one compiled graph per shape).

    ``slots`` ``[T]``: the contiguous slots this forward writes. ``rel_mask`` ``None``: causal, a
    row sees every slot up to its own. ``rel_mask`` ``[T, R]``: a block over the last ``R`` slots
    up to this forward's end (a draft tree's earlier rows of this round, then these rows), with
    every slot before the block visible (the committed prefix)."""
    cols = torch.arange(n_keys, device=slots.device)
    if rel_mask is None:
        return cols[None, :] <= slots[:, None]
    t, r = rel_mask.shape
    rel = cols - (slots[-1] + 1 - r)  # column offset inside the block
    inside = (rel >= 0) & (rel < r)
    block = rel_mask.gather(1, rel.clamp(0, r - 1)[None, :].expand(t, n_keys))
    return (rel < 0)[None, :] | (inside[None, :] & block)


def window_masks(
    windows: Windows | None,  # per layer (None: no layer has a window)
    slots: torch.Tensor,  # [T] cache slots of this forward's rows
    positions: torch.Tensor,  # [T] rope positions of this forward's tokens
    mask: torch.Tensor,  # [T, S] bool: what the rows attend to without windows
) -> dict[int, torch.Tensor] | None:
    """``{layer: [T, S] mask}`` for the sliding-window layers, computed on the device.

    HF (``masking_utils.sliding_window_overlay``): a key at position ``k`` is visible to a query
    at position ``q`` iff ``k > q - window`` (and causal). Committed slots hold the token at
    position == slot; this forward's keys sit at ``positions``. (Rows an earlier draft forward
    of this round wrote after the committed prefix sit at slot >= position: they are the query's
    tree ancestors, within the window as long as the draft tree is shallower than it.)"""
    if windows is None:
        return None
    key_pos = torch.arange(mask.shape[1], device=slots.device).index_copy(0, slots, positions)  # [S]
    out: dict[int, torch.Tensor] = {}
    by_window: dict[int, torch.Tensor] = {}
    for li, w in enumerate(windows):
        if w is None:
            continue
        if w not in by_window:
            by_window[w] = mask & (key_pos[None, :] > positions[:, None] - w)
        out[li] = by_window[w]
    return out or None


def causal_mask(start: int, t: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[T, start + T]`` bool: query i (at slot start+i) sees slots ``<= start + i``."""
    cols = torch.arange(start + t, device=device)
    rows = torch.arange(start, start + t, device=device)
    return cols[None, :] <= rows[:, None]


# query rows per attention call where a row's result must not depend on the call's row count
INVARIANT_ROWS = 32


def sdpa(
    q: torch.Tensor,  # [H, T, D]
    k: torch.Tensor,  # [Hkv, S, D]
    v: torch.Tensor,
    mask: torch.Tensor | None,  # [T, S] bool
    causal: bool,
    scale: float,
    invariant: bool = False,
) -> torch.Tensor:
    """Grouped-query attention without materialising repeated K/V -> ``[H, T, D]``.

    ``invariant``: compute every query row inside a call of exactly ``INVARIANT_ROWS`` rows (the
    rows padded, then cut back), so its result is bit-identical whatever ``T`` is. The CPU kernel
    splits the query rows into blocks whose size follows from ``T``, and a short block takes another
    GEMM path: the last ulp of a row then depends on how many rows share the call. Float32 greedy
    decoding shrugs that off; quantised activations round it into different tokens (a w8a8 verify
    of 11 rows parted from plain decoding on the 1.5B). Not for the causal prefill (run once)."""
    h, t, d = q.shape
    hkv = k.shape[0]
    rep = h // hkv
    if rep == 1 or causal:
        if rep > 1:
            k = k.repeat_interleave(rep, dim=0)
            v = v.repeat_interleave(rep, dim=0)
        if invariant and not causal:
            return _in_blocks(q, k, v, mask, scale)
        return F.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=None if mask is None else mask[None, None],
            is_causal=causal, scale=scale,
        )[0]
    # pack the query heads sharing a K/V head: [Hkv, rep*T, D]; the mask repeats per head
    qp = q.reshape(hkv, rep * t, d)
    mp = None if mask is None else mask.repeat(rep, 1)  # [rep*T, S]
    if invariant:
        return _in_blocks(qp, k, v, mp, scale).reshape(h, t, d)
    out = F.scaled_dot_product_attention(
        qp[None], k[None], v[None], attn_mask=None if mp is None else mp[None, None], scale=scale
    )[0]
    return out.reshape(h, t, d)


def _in_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """``q`` ``[Hk, R, D]`` attended in calls of exactly ``INVARIANT_ROWS`` rows each."""
    rows = q.shape[1]
    padded = -(-rows // INVARIANT_ROWS) * INVARIANT_ROWS
    if padded != rows:
        q = torch.cat([q, q.new_zeros(q.shape[0], padded - rows, q.shape[2])], dim=1)
        if mask is not None:  # padding rows see every slot (their output is dropped)
            mask = torch.cat([mask, mask.new_ones(padded - rows, mask.shape[1])], dim=0)
    outs = [
        F.scaled_dot_product_attention(
            q[None, :, i : i + INVARIANT_ROWS], k[None], v[None], scale=scale,
            attn_mask=None if mask is None else mask[None, None, i : i + INVARIANT_ROWS],
        )[0]
        for i in range(0, padded, INVARIANT_ROWS)
    ]
    return torch.cat(outs, dim=1)[:, :rows]
