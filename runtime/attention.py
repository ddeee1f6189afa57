"""Attention pieces shared by the plain layer loop (``runtime.transformer``) and the layer-plan
executor (``runtime.layer_exec``): RoPE tables, masks (causal, sliding window) and grouped-query
SDPA. Shapes: batch 1, ``q`` ``[H, T, D]``, keys/values ``[Hkv, S, D]``, masks ``[T, S]`` bool
(True = attend).
"""
from __future__ import annotations

from dataclasses import dataclass
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
# keys per invariant attention call grow in steps of this many cache slots (see key_blocks)
KEY_BLOCK = 64

KeyBlocks = tuple[tuple[int, int, int], ...]  # (first row, end row, keys attended) per call group


def round_keys(n: int) -> int:
    """``n`` cache slots rounded up to a whole number of ``KEY_BLOCK`` s."""
    return -(-n // KEY_BLOCK) * KEY_BLOCK


def key_blocks(start: int, t: int) -> KeyBlocks:
    """How the ``t`` rows of a forward writing slots ``[start, start + t)`` attend invariantly: row
    ``r`` (at slot ``start + r``) attends over the first ``round_keys(start + r + 1)`` slots, a key
    count fixed by its own slot alone. Consecutive rows with the same count share a group.

    The CPU kernel's result for a row depends on how many keys the call has (masked or not: the
    softmax's vector tail and the P@V blocking move with it), so attending over the cache's whole
    capacity made a row depend on how big the decoder made its cache: plain decoding and a
    speculative decoder (whose cache holds a verify's width more) parted on a near-tie of the int4
    1.5B (MT-Bench prompt 84, token 95)."""
    out: list[tuple[int, int, int]] = []
    r = 0
    while r < t:
        keys = round_keys(start + r + 1)
        end = min(t, keys - start)  # the rows whose slot is below ``keys``
        out.append((r, end, keys))
        r = end
    return tuple(out)


def sdpa(
    q: torch.Tensor,  # [H, T, D]
    k: torch.Tensor,  # [Hkv, S, D]
    v: torch.Tensor,
    mask: torch.Tensor | None,  # [T, S] bool
    causal: bool,
    scale: float,
) -> torch.Tensor:
    """Grouped-query attention without materialising repeated K/V -> ``[H, T, D]``."""
    h, t, d = q.shape
    hkv = k.shape[0]
    rep = h // hkv
    if rep == 1 or causal:
        if rep > 1:
            k = k.repeat_interleave(rep, dim=0)
            v = v.repeat_interleave(rep, dim=0)
        return F.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=None if mask is None else mask[None, None],
            is_causal=causal, scale=scale,
        )[0]
    # pack the query heads sharing a K/V head: [Hkv, rep*T, D]; the mask repeats per head
    qp = q.reshape(hkv, rep * t, d)
    mp = None if mask is None else mask.repeat(rep, 1)  # [rep*T, S]
    out = F.scaled_dot_product_attention(
        qp[None], k[None], v[None], attn_mask=None if mp is None else mp[None, None], scale=scale
    )[0]
    return out.reshape(h, t, d)


@dataclass(frozen=True)
class InvariantRows:
    """How the rows of one forward attend on the quantised backends (:func:`sdpa_invariant`).

    Contiguous rows (a plain step, a chain's verify, a batch's rows) sit at the slot of their position
    and attend to every slot up to it: they attend over the cache as it is, in the groups of
    ``blocks``. A tree's rows sit past their positions, their ancestors scattered over the round's
    slots: each row's attended slots are gathered (``order``) into the columns a plain step at its
    position would read them from, since the kernel's sums depend on which column holds what."""

    blocks: KeyBlocks  # contiguous rows: (first row, end row, key count) per group
    positions: torch.Tensor | None = None  # [T] a tree's row positions; None for contiguous rows
    order: torch.Tensor | None = None  # [T, K] each tree row's attended slots, ascending (then the rest)
    groups: tuple[tuple[torch.Tensor, int], ...] = ()  # a tree's (rows, key count) groups

    @staticmethod
    def contiguous(start: int, t: int) -> "InvariantRows":
        return InvariantRows(key_blocks(start, t))

    @staticmethod
    def gathered(mask: torch.Tensor, positions: torch.Tensor) -> "InvariantRows":
        """``mask`` ``[T, S]``: the slots each row attends to (no sliding window), which are its
        positions ``0 .. positions[r]`` in ascending slot order. Reads ``positions`` back (the
        quantised backends run on the CPU: no synchronisation)."""
        counts = [round_keys(p + 1) for p in positions.tolist()]
        order = torch.argsort((~mask).to(torch.uint8), dim=1, stable=True)[:, : max(counts)]
        groups = tuple(
            (torch.tensor([r for r, c in enumerate(counts) if c == keys], device=mask.device), keys)
            for keys in sorted(set(counts))
        )
        return InvariantRows((), positions, order, groups)


def attend_rows(
    q: torch.Tensor,  # [H, T, D] float32
    k: torch.Tensor,  # [Hkv, S, D] float32 (a cache layer's keys)
    v: torch.Tensor,
    mask: torch.Tensor,  # [T, M] bool, M <= S: the slots each row attends to (sliding window included)
    scale: float,
) -> torch.Tensor:
    """Attention computed one row at a time by the ggml extension (``runtime.kernels``) -> ``[H, T, D]``.

    Each row visits exactly the slots its mask row shows, in ascending slot order, and sums in an
    order fixed by them: its result depends on its query and those keys and values alone, never on
    the call's other rows, the cache's capacity or padding. So it is row-invariant wherever the
    keys a row sees are laid out in position order, as they are for contiguous rows, a tree's rows
    (ancestors after the committed prefix) and a batch's parts; no key-count rounding or padded
    query blocks are needed (:func:`sdpa_invariant`)."""
    from runtime.kernels import load

    return load().attend(q, k, v, mask, scale)


def sdpa_invariant(
    q: torch.Tensor,  # [H, T, D]
    k: torch.Tensor,  # [Hkv, S, D], S >= every group's key count
    v: torch.Tensor,
    mask: torch.Tensor,  # [T, S] bool: this layer's mask (sliding window included)
    scale: float,
    rows: InvariantRows,
    window: int | None = None,  # this layer's sliding window (gathered rows)
) -> torch.Tensor:
    """Attention whose every row is bit-identical whatever else shares its call and wherever the
    cache holds its keys -> ``[H, T, D]``.

    Each row attends over exactly ``round_keys(position + 1)`` keys laid out as a plain step at its
    position reads them, and its (GQA-packed) query rows run in calls of exactly
    ``INVARIANT_ROWS`` rows (padded, then cut back): the CPU kernel splits a call's query rows into
    blocks whose size follows from the row count, and a short block takes another GEMM path.
    Float32 greedy decoding shrugs such last-ulp differences off; quantised weights and activations
    round them into different tokens (a w8a8 verify of 11 rows parted from plain decoding on the
    1.5B), so the quantised backends without the extension's row kernel (:func:`attend_rows`) attend
    this way after the prefill (which runs once per prompt, the same way in every decoding mode)."""
    h, t, d = q.shape
    hkv = k.shape[0]
    rep = h // hkv
    if rows.order is not None:
        return _gathered(q, k, v, scale, rows, window)
    outs = []
    for lo, hi, keys in rows.blocks:
        n = hi - lo
        qg = q[:, lo:hi].reshape(hkv, rep * n, d)  # heads sharing a K/V head packed; rep == 1 too
        mg = mask[lo:hi, :keys].repeat(rep, 1)
        outs.append(_in_blocks(qg, k[:, :keys], v[:, :keys], mg, scale).reshape(h, n, d))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def _gathered(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, rows: InvariantRows, window: int | None
) -> torch.Tensor:
    """Tree rows: each row's keys gathered into position order, one query block per row."""
    assert rows.order is not None and rows.positions is not None
    h, t, d = q.shape
    hkv = k.shape[0]
    rep = h // hkv
    block = -(-rep // INVARIANT_ROWS) * INVARIANT_ROWS
    cols = torch.arange(rows.order.shape[1], device=q.device)
    pos = rows.positions
    seen = cols[None, :] <= pos[:, None]  # [T, K]: columns 0 .. position, as a plain step's
    if window is not None:  # HF: a key at position c is visible from position p iff c > p - window
        seen &= cols[None, :] > pos[:, None] - window
    out = q.new_empty(h, t, d)
    for idx, keys in rows.groups:
        n = idx.numel()
        order = rows.order[idx, :keys]  # [n, keys]
        kg, vg = k[:, order].transpose(0, 1), v[:, order].transpose(0, 1)  # [n, Hkv, keys, D]
        qg = q[:, idx].reshape(hkv, rep, n, d).permute(2, 0, 1, 3)  # [n, Hkv, rep, D]
        mg = seen[idx, :keys][:, None, None, :].expand(n, 1, rep, keys)
        if block != rep:  # padding rows see every key (their output is dropped)
            qg = torch.cat([qg, qg.new_zeros(n, hkv, block - rep, d)], dim=2)
            mg = torch.cat([mg, mg.new_ones(n, 1, block - rep, keys)], dim=2)
        og = torch.cat([
            F.scaled_dot_product_attention(qg[:, :, i : i + INVARIANT_ROWS], kg, vg, scale=scale,
                                           attn_mask=mg[:, :, i : i + INVARIANT_ROWS])
            for i in range(0, block, INVARIANT_ROWS)
        ], dim=2)[:, :, :rep]  # [n, Hkv, rep, D]
        out[:, idx] = og.permute(1, 2, 0, 3).reshape(h, n, d)
    return out


# from this many blocks of ``INVARIANT_ROWS`` rows on, one call carries them in its batch dimension
BATCHED_BLOCKS = 4


def _in_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """``q`` ``[Hk, R, D]`` attended in blocks of exactly ``INVARIANT_ROWS`` rows each: a call per block,
    or, from ``BATCHED_BLOCKS`` blocks on (a prompt's rows), one call with the blocks in its batch
    dimension, which the CPU kernel runs block by block just as it runs lone calls (bit-identical;
    one call instead of one per block)."""
    hk, rows, d = q.shape
    padded = -(-rows // INVARIANT_ROWS) * INVARIANT_ROWS
    if padded != rows:
        q = torch.cat([q, q.new_zeros(hk, padded - rows, d)], dim=1)
        # padding rows see every slot (their output is dropped)
        mask = torch.cat([mask, mask.new_ones(padded - rows, mask.shape[1])], dim=0)
    blocks = padded // INVARIANT_ROWS
    if blocks >= BATCHED_BLOCKS:
        s = k.shape[1]
        out = F.scaled_dot_product_attention(
            q.reshape(hk, blocks, INVARIANT_ROWS, d).transpose(0, 1), k[None].expand(blocks, hk, s, d),
            v[None].expand(blocks, hk, s, d), scale=scale, attn_mask=mask.reshape(blocks, INVARIANT_ROWS, s)[:, None],
        )  # [blocks, Hk, rows per block, D]
        return out.transpose(0, 1).reshape(hk, padded, d)[:, :rows]
    outs = [
        F.scaled_dot_product_attention(
            q[None, :, i : i + INVARIANT_ROWS], k[None], v[None], scale=scale,
            attn_mask=mask[None, None, i : i + INVARIANT_ROWS],
        )[0]
        for i in range(0, padded, INVARIANT_ROWS)
    ]
    return torch.cat(outs, dim=1)[:, :rows]
