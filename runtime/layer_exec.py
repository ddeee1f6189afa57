"""Executing a model under a layer plan: skipped sub-layers and layer-parallel ("fuzzy") groups.

EasySpec algorithm 2, for a group of consecutive layers ``1..N`` with input ``h_1``::

    a_i = Attn_i(h_1)                      for every member (no dependency between them)
    h'_i = h_i + a_i;  h_{i+1} = h'_i + MLP_i(h'_i)   in order

How a group's attention sub-layers are computed is a registry (``GROUP_EXECUTORS``):

- ``batched``: one batched call over the members' stacked q/k/v/o weights (one device);
- ``loop``: the same algorithm, one member after another (the reference the tests compare with);
- ``distributed`` (``runtime.distributed``): one member per rank, results gathered.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F

from runtime.attention import InvariantRows, apply_rope, causal_mask
from runtime.errors import RuntimeUserError
from search_spaces.layer_plan import LayerPlan

if TYPE_CHECKING:
    from runtime.kv_cache import KVCache


@dataclass
class GroupWeights:
    """The attention weights of a group's executed members, stacked along a leading axis."""

    members: tuple[int, ...]  # layers of the group whose attention runs
    norm_w: torch.Tensor  # [N, H]
    eps: float
    w_qkv: torch.Tensor  # [N, H, Dq + 2 Dkv]
    b_qkv: torch.Tensor | None  # [N, 1, Dq + 2 Dkv]
    w_o: torch.Tensor  # [N, Dq, H]
    b_o: torch.Tensor | None  # [N, 1, H]

    @property
    def layer_slice(self) -> slice | None:
        """The cache layers as one slice when the members are consecutive."""
        first, last = self.members[0], self.members[-1]
        return slice(first, last + 1) if last - first + 1 == len(self.members) else None


@dataclass
class Block:
    layers: tuple[int, ...]
    group: GroupWeights | None  # None: a single layer run normally


@dataclass
class CompiledPlan:
    plan: LayerPlan
    blocks: list[Block]


class BlockDims(Protocol):
    """The shapes :func:`batched_group` needs (``runtime.transformer.ModelDims`` has them)."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int


class BlockModel(Protocol):
    """The block model a layer plan runs on: its decoder layers (HF modules, for the norms), their
    linears, one attention and one MLP sub-layer, the attention scale and an optional recorder.
    ``runtime.transformer.CausalLM`` is one; this module depends on the contract, not on it."""

    dims: BlockDims
    layers: Any  # indexable: layer i's HF module (input_layernorm, post_attention_layernorm, self_attn)
    linears: Any  # indexable: layer i's {name: Linear}
    scale: float
    recorder: "Recorder | None"

    def attention(self, lin: dict[str, Any], x: torch.Tensor, li: int, a: "AttnInputs") -> torch.Tensor: ...

    def mlp(self, lin: dict[str, Any], layer: Any, x: torch.Tensor) -> torch.Tensor: ...

    def normed(self, norm: Any, x: torch.Tensor) -> torch.Tensor: ...  # ``x`` through one of its norm modules


def check_plan_fits(plan: LayerPlan, n_layers: int, what: str = "model") -> None:
    if plan.n_layers != n_layers:
        raise RuntimeUserError(
            f"layer_plan is for a model with {plan.n_layers} layers but the {what} has {n_layers}; "
            "build the plan for this model (e.g. --lp-size / --skip-ratio) or retune"
        )


def compile_plan(lm: "BlockModel", plan: LayerPlan) -> CompiledPlan:
    check_plan_fits(plan, lm.dims.n_layers)
    skip = set(plan.skip_attn)
    blocks = []
    for layers in plan.blocks():
        members = tuple(li for li in layers if li not in skip)
        group = _stack(lm, members) if len(layers) > 1 and members else None
        blocks.append(Block(layers, group))
    return CompiledPlan(plan, blocks)


def _stack(lm: "BlockModel", members: tuple[int, ...]) -> GroupWeights:
    attns = [lm.layers[li].self_attn for li in members]
    norms = [lm.layers[li].input_layernorm for li in members]

    def cat_bias(mods: list[Any]) -> torch.Tensor | None:
        if all(getattr(m, "bias", None) is None for m in mods):
            return None
        return torch.cat([m.bias if m.bias is not None else torch.zeros(m.weight.shape[0]) for m in mods])

    w_qkv, b_qkv = [], []
    for a in attns:
        mods = [a.q_proj, a.k_proj, a.v_proj]
        w_qkv.append(torch.cat([m.weight for m in mods]).t())
        b_qkv.append(cat_bias(mods))
    has_b = any(b is not None for b in b_qkv)
    o_bias = [getattr(a.o_proj, "bias", None) for a in attns]
    return GroupWeights(
        members=members,
        norm_w=torch.stack([n.weight.detach() for n in norms]),
        eps=float(getattr(norms[0], "variance_epsilon", getattr(norms[0], "eps", 1e-6))),
        w_qkv=torch.stack(w_qkv).detach().contiguous(),
        b_qkv=torch.stack([b for b in b_qkv])[:, None, :].detach() if has_b else None,
        w_o=torch.stack([a.o_proj.weight.t() for a in attns]).detach().contiguous(),
        b_o=torch.stack(o_bias)[:, None, :].detach() if all(b is not None for b in o_bias) else None,
    )


@dataclass
class AttnInputs:
    """What every attention sub-layer of one forward shares (all on the device; shapes static
    except a prefill's exact-length ``key_len``)."""

    cache: "KVCache"
    cos: torch.Tensor
    sin: torch.Tensor
    mask: torch.Tensor | None  # [T, S] bool, or None: causal (``causal``) or attend to all
    causal: bool
    windowed: dict[int, torch.Tensor] | None = None  # layer -> its own [T, S] mask (sliding windows)
    slots: torch.Tensor | None = None  # [T] cache slots written (None: after the cache's length)
    key_len: int | None = None  # attend over the first key_len slots (None: the whole capacity)
    invariant: InvariantRows | None = None  # how rows attend on the quantised backends (sdpa_invariant, or ROW_KERNEL)

    def mask_for(self, li: int) -> tuple[torch.Tensor | None, bool]:
        """The ``(mask, causal)`` attention sub-layer ``li`` uses."""
        if self.windowed is not None and li in self.windowed:
            return self.windowed[li], False
        return self.mask, self.causal


class Recorder(Protocol):
    """Optional observer of a forward (``CausalLM.recorder``; ``None``, the default, records nothing).

    ``attn_input(li, h)``: the hidden state ``[T, H]`` attention sub-layer ``li`` reads (before its
    norm; in a layer-parallel group, the group's input). ``attn(li, q, k, v, out)``: its queries
    ``[Hq, T, D]``, keys and values ``[Hkv, T, D]`` (after RoPE) and output ``[T, H]`` (after
    ``o_proj``). :func:`run_blocks` and the attention code call it; while a recorder is set,
    ``CausalLM.forward`` runs plan-less forwards through :func:`run_blocks` too (identity plan)."""

    def attn_input(self, li: int, h: torch.Tensor) -> None: ...

    def attn(self, li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None: ...


GroupExecutor = Callable[["BlockModel", GroupWeights, torch.Tensor, AttnInputs], dict[int, torch.Tensor]]


def loop_group(lm: "BlockModel", g: GroupWeights, h1: torch.Tensor, a: AttnInputs) -> dict[int, torch.Tensor]:
    """Reference: each member's attention on the group input, one after another."""
    return {
        li: lm.attention(lm.linears[li], lm.layers[li].input_layernorm(h1), li, a)
        for li in g.members
    }


def batched_group(lm: "BlockModel", g: GroupWeights, h1: torch.Tensor, a: AttnInputs) -> dict[int, torch.Tensor]:
    """All members' attention in one batched computation over stacked weights."""
    q, k, v = _group_qkv(lm, g, h1)
    out, q, k = _group_attend(lm, g, q, k, v, a)
    o = _group_out(g, out)  # [N, T, H]
    if lm.recorder is not None:
        for i, li in enumerate(g.members):
            lm.recorder.attn(li, q[i], k[i], v[i], o[i])
    return {li: o[i] for i, li in enumerate(g.members)}


def batched_group_rows(
    lm: "BlockModel", g: GroupWeights, h1: torch.Tensor, inputs: list[AttnInputs], sizes: list[int]
) -> dict[int, torch.Tensor]:
    """:func:`batched_group` over several sequences' rows at once (``CausalLM.forward_batch`` under a
    plan): ``h1`` ``[R, H]`` holds sequence i's ``sizes[i]`` rows in turn, each attending to its own
    cache under its own ``inputs[i]``; the stacked projections run over all ``R`` rows in one call."""
    q, k, v = _group_qkv(lm, g, h1)  # [N, H, R, D]
    outs = [_group_attend(lm, g, qi, ki, vi, a)[0]
            for qi, ki, vi, a in zip(q.split(sizes, dim=2), k.split(sizes, dim=2), v.split(sizes, dim=2), inputs)]
    o = _group_out(g, torch.cat(outs, dim=1))
    return {li: o[i] for i, li in enumerate(g.members)}


def _group_qkv(lm: "BlockModel", g: GroupWeights, h1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every member's q, k, v of the shared input ``h1`` ``[T, H]`` -> ``[N, heads, T, D]`` each (no RoPE)."""
    d = lm.dims
    n, t = len(g.members), h1.shape[0]
    dq, dkv = d.n_heads * d.head_dim, d.n_kv_heads * d.head_dim
    # RMSNorm of the shared input once, scaled by every member's own weight (as HF computes it)
    hf = h1.float()
    normed = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + g.eps)).to(h1.dtype)
    x = g.norm_w[:, None, :] * normed[None]  # [N, T, H]
    qkv = torch.baddbmm(g.b_qkv, x, g.w_qkv) if g.b_qkv is not None else torch.bmm(x, g.w_qkv)
    q = qkv[..., :dq].reshape(n, t, d.n_heads, d.head_dim).transpose(1, 2)  # [N, H, T, D]
    k = qkv[..., dq : dq + dkv].reshape(n, t, d.n_kv_heads, d.head_dim).transpose(1, 2)
    v = qkv[..., dq + dkv :].reshape(n, t, d.n_kv_heads, d.head_dim).transpose(1, 2)
    return q, k, v


def _group_attend(
    lm: "BlockModel", g: GroupWeights, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: AttnInputs
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RoPE, every member's K/V written to ``a.cache``, attention under ``a``'s masks -> (output
    ``[N, T, Dq]`` before the o-projections, q and k after RoPE)."""
    d = lm.dims
    n, t = q.shape[0], q.shape[2]
    q, k = apply_rope(q, a.cos, a.sin), apply_rope(k, a.cos, a.sin)
    layers = g.layer_slice
    if layers is not None:
        keys, values = a.cache.write_layers(layers, k, v, a.slots, a.key_len)  # [N, Hkv, S, D]
    else:
        kv = [a.cache.write(li, k[i], v[i], a.slots, a.key_len) for i, li in enumerate(g.members)]
        keys, values = torch.stack([x[0] for x in kv]), torch.stack([x[1] for x in kv])
    rep = d.n_heads // d.n_kv_heads
    qp = q.reshape(n, d.n_kv_heads, rep * t, d.head_dim)
    mp = _group_mask(a, g.members, t, keys.shape[-2], rep, q.device)
    out = F.scaled_dot_product_attention(qp, keys, values, attn_mask=mp, scale=lm.scale)
    return out.reshape(n, d.n_heads, t, d.head_dim).transpose(1, 2).reshape(n, t, d.n_heads * d.head_dim), q, k


def _group_out(g: GroupWeights, out: torch.Tensor) -> torch.Tensor:
    """The members' o-projections: ``[N, T, Dq]`` -> ``[N, T, H]``."""
    return torch.baddbmm(g.b_o, out, g.w_o) if g.b_o is not None else torch.bmm(out, g.w_o)


def _group_mask(
    a: AttnInputs, members: tuple[int, ...], t: int, s: int, rep: int, device: torch.device
) -> torch.Tensor | None:
    """The SDPA mask of a batched group, its rows repeated per packed query head: ``[1, 1, rep*T, S]``
    when every member shares one mask, ``[N, 1, rep*T, S]`` when sliding windows differ."""
    per_member = [a.mask_for(li) for li in members]
    if all(m is per_member[0][0] for m, _ in per_member):  # one mask for the whole group
        mask, causal = per_member[0]
        if mask is None and not causal:
            return None
        per_member = per_member[:1]
    full = [
        m if m is not None else causal_mask(0, t, device) if c else torch.ones(t, s, dtype=torch.bool, device=device)
        for m, c in per_member
    ]
    return torch.stack(full).repeat(1, rep, 1)[:, None]


GROUP_EXECUTORS: dict[str, GroupExecutor] = {
    "batched": batched_group,
    "loop": loop_group,
}
# a linear backend whose groups do not run "batched" (stacked float weights in one bmm): the GGUF
# blocks run each member through the precision's own kernels, and a tree loaded from the blocks
# alone (runtime.gguf_model) has no float weights to stack
BACKEND_GROUP_EXECUTORS: dict[str, str] = {"gguf": "loop"}


def run_blocks(
    lm: "BlockModel", cp: CompiledPlan, h: torch.Tensor, a: AttnInputs, executor: str = "batched"
) -> torch.Tensor:
    """The decoder layers of ``lm`` under a compiled plan: ``h`` ``[T, H]`` in, ``[T, H]`` out."""
    plan = cp.plan
    skip_attn, skip_mlp = set(plan.skip_attn), set(plan.skip_mlp)
    run_group = GROUP_EXECUTORS[executor]
    rec = lm.recorder
    for block in cp.blocks:
        attn_out: dict[int, torch.Tensor] = {}
        if block.group is not None:
            if rec is not None:
                for li in block.group.members:
                    rec.attn_input(li, h)
            attn_out = run_group(lm, block.group, h, a)
        for li in block.layers:
            layer, lin = lm.layers[li], lm.linears[li]
            if block.group is None and li not in skip_attn:
                if rec is not None:
                    rec.attn_input(li, h)
                h = h + lm.attention(lin, lm.normed(layer.input_layernorm, h), li, a)
            elif li in attn_out:
                h = h + attn_out[li]
            if li not in skip_mlp:
                h = h + lm.mlp(lin, layer, lm.normed(layer.post_attention_layernorm, h))
    return h
