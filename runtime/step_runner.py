"""Which way a model's forward runs: eager, compiled (``torch.compile`` of ``CausalLM.step``), or on
a compiled model's K/V slots (``runtime.slots``). One ``StepRunner`` per model decides; the model
holds only the math."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from runtime.attention import attend_mask, window_masks
from runtime.compiled import compile_step, cuda_graphs, note_step, run_step, step_key
from runtime.errors import RuntimeUserError
from runtime.kv_cache import KVCache
from runtime.layer_exec import AttnInputs, CompiledPlan, batched_group_rows
from runtime.layout import CHAIN, ROW_KERNEL, BatchPart, Layout, invariant_rows
from runtime.linear import Linear, row_way
from runtime.linear import run_rows as run_linear_rows
from runtime.slots import SlotView, slot_parts, slot_step
from search_spaces.layer_plan import LayerPlan

CausalLM = Any  # a ``runtime.transformer.CausalLM`` (which imports this module)


class StepRunner:
    """Runs ``lm``'s forwards: a lone forward (``forward``), rows at given slots (``rows``) and
    several sequences' rows at once (``batch``), each the eager, compiled or slot way."""

    def __init__(self, lm: CausalLM) -> None:
        self.lm = lm
        self.compiled: Callable[..., torch.Tensor] | None = None  # ``lm.step`` compiled (``compile``)

    @property
    def is_compiled(self) -> bool:
        return self.compiled is not None

    def compile(self, enabled: bool = True) -> None:
        """Run every forward after the prefill through ``torch.compile(fullgraph=True,
        dynamic=False)`` (CUDA graphs on CUDA; ``runtime.compiled``). Needs the dense linear
        backend: packed and int8 GEMMs are opaque to the compiler."""
        if enabled and self.lm.backend != "dense":
            raise RuntimeUserError(
                f"compiled steps need the dense linear backend, but this model runs '{self.lm.backend}' "
                "projections; use float weights (e.g. --draft-precision float32) with --compile"
            )
        self.compiled = compile_step(self.lm.step, self.lm.device) if enabled else None

    def forward(self, tokens: torch.Tensor, cache: KVCache, layout: Layout = CHAIN,
                logits_for: slice | torch.Tensor | None = None, plan: LayerPlan | None = None) -> torch.Tensor:
        """``CausalLM.forward``: a prefill runs eagerly at its exact length (on a model whose rows are
        reusable, as a step runs); a compiled model's lone
        step on a K/V slot runs as the batched steps run (the row bucket's graph over the slot
        cache); any other step runs over the cache's whole capacity, compiled where the model is."""
        lm = self.lm
        t = tokens.shape[0]
        start = cache.length
        cache.check_room(t)
        lm.rope.ensure(cache.capacity + 1, lm.device)
        full = None
        if layout.mask is not None:  # pad the explicit mask to the capacity: slots past this forward are hidden
            full = torch.zeros(t, cache.capacity, dtype=torch.bool, device=lm.device)
            full[:, : start + t] = layout.mask.to(lm.device)
        # a prompt runs as a prefill (exact length, causal) unless every row must be computed as a
        # step computes it: then a prefix cache's rows equal a fresh prefill's (``rows_reusable``)
        prefill = layout.prefill(start, t) and not lm.rows_reusable
        cp = None if plan is None or plan.is_identity else lm.compiled(plan)
        if cp is None and lm.recorder is not None:  # a recorder sees every forward through run_blocks
            cp = lm.compiled(LayerPlan(n_layers=lm.dims.n_layers))
        compiled = self.compiled is not None and not prefill and lm.recorder is None
        if compiled and cp is None and full is None and isinstance(cache, SlotView) and cuda_graphs(lm.device):
            return slot_step(lm, cache.owner, [BatchPart(tokens, cache, layout.positions, layout.rel_mask, logits_for)])[0]
        args = (tokens, cache.slots(t), layout.positions, layout.rel_mask, full, cache, cp, logits_for,
                start + t if prefill else None)
        if compiled:
            note_step(step_key(lm, tokens, layout.rel_mask, cp, layout.positions is None, full is None,
                               _rows_key(logits_for), cache.capacity))
            logits = run_step(self.compiled, lm.device, *args)
        else:
            logits = lm.step(*args)
        cache.advance(t)
        return logits

    def rows(self, tokens: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
             cache: KVCache) -> torch.Tensor:
        """``CausalLM.forward_rows``: static shapes, compiled where the model is (one graph per ``T``)."""
        lm = self.lm
        if lm.invariant or lm.windows is not None:
            raise ValueError("forward_rows needs a model without row-invariant kernels or sliding windows "
                             "(its explicit masks span every slot of the cache)")
        args = (tokens, slots, positions, None, mask, cache, None, None, None)
        if self.compiled is not None and lm.recorder is None:
            note_step(step_key(lm, tokens, None, None, False, False, None, cache.capacity))
            return run_step(self.compiled, lm.device, *args)
        return lm.step(*args)

    def batch(self, parts: Sequence[BatchPart], plan: LayerPlan | None = None) -> list[torch.Tensor]:
        """``CausalLM.forward_batch``: one static-shape forward where every part's cache is a slot of
        one ``SlotCache`` of a compiled model (``runtime.slots.slot_step``), else ragged and eager."""
        lm = self.lm
        cp = None if plan is None or plan.is_identity else lm.compiled(plan)
        slot_cache = (slot_parts(parts) if cp is None and self.is_compiled and not lm.invariant
                      and lm.windows is None else None)
        if slot_cache is not None:
            lm.rope.ensure(slot_cache.capacity + 1, lm.device)
            return slot_step(lm, slot_cache, parts)
        return ragged_batch(lm, parts, cp)


def ragged_batch(lm: CausalLM, parts: Sequence[BatchPart], cp: CompiledPlan | None) -> list[torch.Tensor]:
    """Several sequences' new rows in one eager forward: each part appends to its own cache and
    attends only to it, under its own mask, exactly as a lone forward would run it; projections,
    MLPs and the head run over every part's rows at once (``runtime.linear.run_rows``), and a
    layer-parallel group's members over every part's rows in one stacked call."""
    sizes = [int(p.tokens.shape[0]) for p in parts]
    inputs = []
    for p, t in zip(parts, sizes):
        p.cache.check_room(t)
        lm.rope.ensure(p.cache.capacity + 1, lm.device)
        slots = p.cache.slots(t)
        positions = slots if p.positions is None else p.positions
        cos, sin = lm.rope.lookup(positions)
        mask = attend_mask(slots, p.cache.capacity, p.rel_mask)
        windowed = window_masks(lm.windows, slots, positions, mask)
        inv = None
        if lm.invariant:
            inv = ROW_KERNEL if lm.row_attention else invariant_rows(t, p.cache.length, positions, p.rel_mask, None, mask)
        inputs.append(AttnInputs(p.cache, cos, sin, mask, False, windowed, slots, None, inv))
    h = lm.embed(torch.cat([p.tokens for p in parts]))  # [R, H]
    way = row_way(lm.row_ways, sum(sizes))

    def run_rows(lin: Linear, x: torch.Tensor) -> torch.Tensor:
        return run_linear_rows(lin, x, way)

    def attention(li: int, layer: Any, lin: dict[str, Linear], h: torch.Tensor) -> torch.Tensor:
        q, k, v = (y.split(sizes) for y in lm._qkv(lin, lm.normed(layer.input_layernorm, h), run_rows))
        outs = [lm._attend(*qkv, li, a)[0] for *qkv, a in zip(q, k, v, inputs)]
        return run_rows(lin["o"], torch.cat(outs))

    blocks = [((li,), None) for li in range(len(lm.layers))] if cp is None else [(b.layers, b.group) for b in cp.blocks]
    skip_attn, skip_mlp = (set(), set()) if cp is None else (set(cp.plan.skip_attn), set(cp.plan.skip_mlp))
    for layers, group in blocks:  # as runtime.layer_exec.run_blocks, over every part's rows
        grouped = {} if group is None else batched_group_rows(lm, group, h, inputs, sizes)
        for li in layers:
            layer, lin = lm.layers[li], lm.linears[li]
            if group is None and li not in skip_attn:
                h = h + attention(li, layer, lin, h)
            elif li in grouped:
                h = h + grouped[li]
            if li not in skip_mlp:
                h = h + lm.mlp(lin, layer, lm.normed(layer.post_attention_layernorm, h), run_rows)
    if any(p.logits_for is not None for p in parts):  # only the rows each part asks for reach the head
        h = torch.cat([hp if p.logits_for is None else hp[p.logits_for] for p, hp in zip(parts, h.split(sizes))])
        sizes = [int(p.tokens.shape[0]) if p.logits_for is None else len(range(p.tokens.shape[0])[p.logits_for])
                 for p in parts]
    logits = run_rows(lm.head, lm.normed(lm.norm, h))
    for p in parts:
        p.cache.advance(int(p.tokens.shape[0]))
    return list(logits.split(sizes))


def _rows_key(rows: slice | torch.Tensor | None) -> Any:
    if isinstance(rows, slice):
        return (rows.start, rows.stop, rows.step)
    return None if rows is None else tuple(rows.shape)
