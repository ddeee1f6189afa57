"""Our own forward pass over a loaded HF decoder's modules (llama / qwen2 families).

We own the layer loop, RoPE, attention (SDPA with an explicit mask) and the KV cache; the HF
modules only provide weights (embeddings, norms, q/k/v/o projections, MLP, final norm, lm_head).
Hidden states are ``[T, H]``: one sequence's rows, or several sequences' rows side by side
(``forward_batch``), each attending to its own cache.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from runtime.attention import (
    RotaryTable, Windows, attend_mask, attend_rows, check_rope, layer_type_windows, mistral_windows,
    no_windows, round_keys, sdpa, sdpa_invariant, window_masks,
)
from runtime.compiled import bucketed, cuda_graphs
from runtime.errors import RuntimeUserError
from runtime.fused import RowKernels, silu_mlp
from runtime.kv_cache import KVCache
from runtime.layer_exec import BACKEND_GROUP_EXECUTORS, AttnInputs, CompiledPlan, Recorder, compile_plan, run_blocks
from runtime.layout import CHAIN, ROW_KERNEL, BatchPart, Layout, invariant_rows
from runtime.linear import (
    FUSED_BACKENDS, FUSED_PROJECTIONS, ROW_INVARIANT_BACKENDS, Linear, bf16_prefill,
    head_backend, make_linear, prefill_linear,
)
from runtime.slots import SlotCache
from runtime.step_runner import StepRunner
from search_spaces.layer_plan import LayerPlan


RunLinear = Callable[[Linear, torch.Tensor], torch.Tensor]  # how a projection is applied to rows


def _apply(linear: Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x)


@dataclass(frozen=True)
class Family:
    """How to find the decoder parts inside an HF model of one architecture family."""

    layers_attr: str = "model.layers"
    embed_attr: str = "model.embed_tokens"
    norm_attr: str = "model.norm"
    rotary_attr: str = "model.rotary_emb"
    windows: Callable[[Any], Windows] = no_windows  # which layers attend through a sliding window


FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "qwen2": Family(windows=layer_type_windows),
    "mistral": Family(windows=mistral_windows),
}


def _get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class ModelDims:
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    max_positions: int


# compiled layer plans kept per model (each grouped plan holds a stacked copy of its groups' weights)
MAX_COMPILED_PLANS = 8


class CausalLM(RowKernels):
    """A decoder-only LM executed by our own layer loop over the HF module tree."""

    def __init__(self, hf_model: Any) -> None:
        cfg = hf_model.config
        family = FAMILIES.get(cfg.model_type)
        if family is None:
            raise RuntimeUserError(
                f"unsupported model family '{cfg.model_type}'; supported: {', '.join(sorted(FAMILIES))}"
            )
        self.hf_model = hf_model
        self.config = cfg
        self.layers = list(_get(hf_model, family.layers_attr))
        self.embed = _get(hf_model, family.embed_attr)
        self.norm = _get(hf_model, family.norm_attr)
        self.lm_head = hf_model.lm_head
        rotary = _get(hf_model, family.rotary_attr)
        check_rope(cfg, rotary)
        n_heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
        self.dims = ModelDims(
            n_layers=len(self.layers),
            n_heads=n_heads,
            n_kv_heads=getattr(cfg, "num_key_value_heads", None) or n_heads,
            head_dim=head_dim,
            hidden=cfg.hidden_size,
            vocab=self.lm_head.weight.shape[0],
            max_positions=cfg.max_position_embeddings,
        )
        self.dtype = self.lm_head.weight.dtype
        self.device = self.norm.weight.device  # the head's weight may exist only as GGUF blocks (runtime.gguf_model)
        self.rope = RotaryTable(
            rotary.inv_freq, float(getattr(rotary, "attention_scaling", 1.0)), self.dtype, self.device,
            min(self.dims.max_positions, RotaryTable.PRECOMPUTED_POSITIONS),
        )
        self.scale = head_dim**-0.5
        windows = family.windows(cfg)
        self.windows: Windows | None = windows if any(w is not None for w in windows) else None
        self.head_rows: int | None = None  # restrict the output head to ids [0, head_rows)
        self.backend, self.width, self.head_backend = "dense", 1, "dense"
        self.linears: list[dict[str, Linear]] = []
        # {"linears": ...}: the prefill's projections, built on the first prefill that uses them and
        # shared (the dict itself) by every wrapper sharing this one's linears
        self._prefill: dict[str, list[dict[str, Linear]]] = {}
        self._fused: list[tuple[Any, ...]] | None = None  # per layer, what ``kernels.layer`` runs (RowKernels)
        self.head: Linear = self._build_head()
        self.use_linear_backend("dense")
        self.row_ways: dict[int, str] = {}  # rows -> how a batched step runs them (runtime.linear.run_rows)
        self.recorder: Recorder | None = None  # observes attention sub-layers (diagnostics only)
        self._plans: OrderedDict[LayerPlan, CompiledPlan] = OrderedDict()  # LRU, see compiled()
        self.steps = StepRunner(self)  # eager, compiled or slot forwards (see compile_steps())
        self._static_caches: dict[int, KVCache] = {}  # compiled on CUDA: one cache per capacity (new_cache)
        self.slots: SlotCache | None = None  # where this wrapper's sequences keep their K/V (runtime.slots), if set

    @property
    def invariant(self) -> bool:
        """Whether every row of a forward is computed bit-identically whatever the call's other rows
        and the cache's capacity: the quantised backends (row-invariant kernels and attention), which
        round last-ulp differences into different tokens."""
        return self.backend in ROW_INVARIANT_BACKENDS

    @property
    def rows_reusable(self) -> bool:
        """Whether every K/V row is bit-identical however it was computed: a prompt chunk, a step, a
        verify or a batched row (row-invariant projections and attention everywhere, the prefill
        included; ``StepRunner.forward``). A prefix cache may then hand any committed row of one
        sequence to another (``runtime.prefix_cache``); otherwise only whole prefill chunks."""
        return self.invariant and not bf16_prefill(self.backend)

    @property
    def is_compiled(self) -> bool:
        return self.steps.is_compiled

    def compile_steps(self, enabled: bool = True) -> None:
        """Compile every forward after the prefill (``StepRunner.compile``)."""
        self.steps.compile(enabled)

    def use_linear_backend(self, backend: str, width: int = 1, draft: bool = False) -> None:
        """Execute every projection (and the head) with ``backend`` (see ``runtime.linear``);
        ``draft``: this wrapper only drafts, so its head may run a faster, inexact backend
        (``runtime.linear.DRAFT_HEAD_BACKENDS``)."""
        self.backend, self.width, self.head_backend = backend, width, head_backend(backend, draft)
        self.group_executor = BACKEND_GROUP_EXECUTORS.get(backend, "batched")  # how layer-parallel groups run
        fuse = backend in FUSED_BACKENDS
        self.linears = [
            _layer_linears(layer, lambda w, b, src: make_linear(backend, w, b, width, src), fuse, backend)
            for layer in self.layers
        ]
        self._prefill = {}
        self._fused = None
        self.head = self._build_head()

    def prefill_linears(self) -> list[dict[str, Linear]]:
        """The projections a prefill runs: bf16 copies where this backend's many-row calls are slow
        (``runtime.linear.bf16_prefill``), else the step's own. Every decoding mode prefills a prompt
        the same way, so speculative output stays identical to plain decoding; a prompt's K/V then
        come from bf16 weights rather than the int4/int8 kernels (agreement in docs/benchmarks.md)."""
        if not bf16_prefill(self.backend):
            return self.linears
        if "linears" not in self._prefill:
            self._prefill["linears"] = [
                {name: prefill_linear(mod.weight, mod.bias, _source(mod, self.backend))
                 for name, mod in _projections(layer)}
                for layer in self.layers
            ]
        return self._prefill["linears"]

    def share_linears_from(self, other: "CausalLM") -> None:
        """Reuse ``other``'s executed projections (e.g. one packed copy of the weights per width)."""
        if other.hf_model is not self.hf_model:
            raise ValueError("can only share linears between wrappers of the same model")
        self.backend, self.width, self.head_rows = other.backend, other.width, other.head_rows
        self.head_backend, self.group_executor = other.head_backend, other.group_executor
        self.linears, self.head = other.linears, other.head
        self._prefill = other._prefill
        self._fused = other._fused
        self._plans = other._plans

    def compiled(self, plan: LayerPlan) -> CompiledPlan:
        """``plan`` compiled for this model (stacked group weights), cached per plan; the least
        recently used plan is dropped beyond ``MAX_COMPILED_PLANS`` (a tuner scores hundreds)."""
        hit = self._plans.get(plan)
        if hit is None:
            hit = self._plans[plan] = compile_plan(self, plan)
            while len(self._plans) > MAX_COMPILED_PLANS:
                self._plans.popitem(last=False)
        self._plans.move_to_end(plan)
        return hit

    def _build_head(self) -> Linear:
        w, b = self.lm_head.weight, getattr(self.lm_head, "bias", None)
        source = _source(self.lm_head, self.head_backend)
        if self.head_rows is not None:
            w = w[: self.head_rows].contiguous()
            b = None if b is None else b[: self.head_rows].contiguous()
            source = None if source is None else source.rows(self.head_rows)
        backend = self.head_backend
        return make_linear(backend, w, b, self.width, source if backend == self.backend else None)

    def new_cache(self, capacity: int, reuse: bool = False) -> KVCache:
        """An empty cache of at least ``capacity`` slots. ``reuse``: it is the cache of a sequence
        (a decoder's, or its drafter's), which compiled CUDA steps keep per capacity (see
        ``_static_cache``); a timing or scoring forward asks without it and never gets a live
        sequence's cache."""
        if self.is_compiled:  # one cache shape (hence one graph set) for many prompts
            capacity = bucketed(capacity)
        elif self.invariant:  # room for every row's whole key block (runtime.attention.key_blocks)
            capacity = round_keys(capacity)
        self.rope.ensure(capacity + 1, self.device)
        if self.is_compiled and cuda_graphs(self.device):
            return self._static_cache(capacity, reuse)
        d = self.dims
        return KVCache(d.n_layers, d.n_kv_heads, d.head_dim, capacity, self.dtype, self.device)

    def _static_cache(self, capacity: int, reuse: bool) -> KVCache:
        """A cache that compiled CUDA steps write, its tensors marked static.

        CUDA graphs replay fixed addresses, and a step's ``index_copy_`` into a cache passed as an
        ordinary input made inductor skip CUDA graphs for every step ("mutated inputs"). Marked static
        (``mark_static_address``, unguarded: a new address re-records the graph, never recompiles
        it), the steps run as graphs. A sequence's cache (``reuse``) is kept, one per capacity
        bucket, and handed out again, emptied, for the wrapper's next sequence, so its graphs
        replay without re-recording: a wrapper decodes one sequence at a time (each decoder has
        its own). Any other cache is a new one (a cost model timing a forward mid-decode must not
        empty the live sequence's)."""
        cache = self._static_caches.get(capacity) if reuse else None
        if cache is None:
            d = self.dims
            cache = KVCache(d.n_layers, d.n_kv_heads, d.head_dim, capacity, self.dtype, self.device)
            torch._dynamo.mark_static_address(cache.all_keys, guard=False)
            torch._dynamo.mark_static_address(cache.all_values, guard=False)
            if reuse:
                self._static_caches[capacity] = cache
        cache.rollback(0)
        return cache

    def restrict_head(self, n_tokens: int | None) -> None:
        """Compute logits only for token ids ``[0, n_tokens)`` (BPE ids are roughly ordered by
        frequency). Only for drafts: the target's head must stay whole for lossless verification."""
        full = self.lm_head.weight.shape[0]
        self.head_rows = None if n_tokens is None or n_tokens >= full else n_tokens
        self.head = self._build_head()

    # ------------------------------------------------------------------ forward
    def attention(self, lin: dict[str, Linear], x: torch.Tensor, li: int, a: AttnInputs) -> torch.Tensor:
        """Attention sub-layer ``li`` on ``x`` ``[T, H]`` (already normed): writes its K/V to the
        cache at ``a.slots`` and attends under ``a``'s mask for this layer."""
        out, q, k, v = self._attend(*self._qkv(lin, x), li, a)
        o = lin["o"](out)
        if self.recorder is not None:
            self.recorder.attn(li, q, k, v, o)
        return o

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, li: int, a: AttnInputs
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Projected rows ``[T, *]`` -> RoPE, K/V written to ``a.cache``, attention under ``a``'s
        mask for layer ``li`` -> (output ``[T, H*D]`` before the o-projection, q, k, v)."""
        d = self.dims
        t = q.shape[0]
        q = q.view(t, d.n_heads, d.head_dim).transpose(0, 1)  # [H, T, D]
        k = k.view(t, d.n_kv_heads, d.head_dim).transpose(0, 1)  # [Hkv, T, D]
        v = v.view(t, d.n_kv_heads, d.head_dim).transpose(0, 1)
        q, k = self.rotate(q, a.cos, a.sin), self.rotate(k, a.cos, a.sin)
        keys, values = a.cache.write(li, k, v, a.slots, a.key_len)  # [Hkv, S, D]
        mask, causal = a.mask_for(li)
        if a.invariant is not None and self.row_attention:  # a row attends the same whatever shares its call
            out = attend_rows(q, keys, values, mask, self.scale)  # [H, T, D]
        elif a.invariant is not None:
            window = None if self.windows is None else self.windows[li]
            out = sdpa_invariant(q, keys, values, mask, self.scale, a.invariant, window)  # [H, T, D]
        else:
            out = sdpa(q, keys, values, mask, causal, self.scale)
        return out.transpose(0, 1).reshape(t, d.n_heads * d.head_dim), q, k, v

    def _qkv(self, lin: dict[str, Linear], x: torch.Tensor, run: RunLinear = _apply) -> tuple[torch.Tensor, ...]:
        """q, k and v projected from ``x`` (each projection through ``run``): one call where the
        backend fuses them."""
        if "qkv" in lin:
            d = self.dims
            dkv = d.n_kv_heads * d.head_dim
            return tuple(run(lin["qkv"], x).split([d.n_heads * d.head_dim, dkv, dkv], dim=-1))
        return run(lin["q"], x), run(lin["k"], x), run(lin["v"], x)

    def mlp(self, lin: dict[str, Linear], layer: Any, x: torch.Tensor, run: RunLinear = _apply) -> torch.Tensor:
        if "gate_up" in lin and self.row_attention and silu_mlp(layer):
            return run(lin["down"], self.kernels.swiglu(run(lin["gate_up"], x)))
        if "gate_up" in lin:
            gate, up = run(lin["gate_up"], x).chunk(2, dim=-1)
        else:
            gate, up = run(lin["gate"], x), run(lin["up"], x)
        return run(lin["down"], layer.mlp.act_fn(gate) * up)

    def forward(self, tokens: torch.Tensor, cache: KVCache, layout: Layout = CHAIN,
                logits_for: slice | torch.Tensor | None = None, plan: LayerPlan | None = None) -> torch.Tensor:
        """Run ``T`` new tokens (``[T]`` long), append their K/V to ``cache``, return logits ``[T', V]``
        (``logits_for``: which rows; None: all). The rows attend as ``layout`` says (causal after the
        cache by default; ``runtime.layout``); ``plan`` runs the layers as a layer plan says, its
        skipped attention sub-layers writing no K/V. ``self.steps`` picks the eager, compiled or slot way."""
        return self.steps.forward(tokens, cache, layout, logits_for, plan)

    __call__ = forward

    def step(
        self,
        tokens: torch.Tensor,  # [T]
        slots: torch.Tensor,  # [T] cache slots written
        positions: torch.Tensor | None,  # [T]; None: the slots
        rel_mask: torch.Tensor | None,
        full: torch.Tensor | None,  # [T, S] explicit mask
        cache: KVCache,
        cp: CompiledPlan | None,
        logits_for: slice | torch.Tensor | None,
        key_len: int | None,  # a prefill (or a prompt's later chunk): causal over exactly these slots
    ) -> torch.Tensor:
        """One forward with static shapes (what ``torch.compile`` captures): ``tokens`` -> logits."""
        if positions is None:
            positions = slots
        cos, sin = self.rope.lookup(positions)
        if key_len is not None:  # prefill: exact length, causal (a later chunk, sliding windows: explicit masks)
            mask = None if self.windows is None and key_len == tokens.shape[0] else attend_mask(slots, key_len, None)
        else:
            mask = full if full is not None else attend_mask(slots, cache.capacity, rel_mask)
        windowed = None if mask is None else window_masks(self.windows, slots, positions, mask)
        inv = None
        if self.invariant and key_len is None:  # never compiled (dense only): host ints and reads are free
            inv = ROW_KERNEL if self.row_attention else invariant_rows(
                tokens.shape[0], cache.length, positions, rel_mask, full, mask)
        a = AttnInputs(cache, cos, sin, mask, mask is None, windowed, slots, key_len, inv)
        h = self.embed(tokens)  # [T, H]
        fused = self.fused_layers() if cp is None and inv is not None else None
        if fused is not None:  # each layer in one call of the extension (the loop below, bit for bit)
            h = self.run_fused(fused, h, a)
        elif cp is None:
            linears = self.prefill_linears() if key_len is not None else self.linears
            for li, layer in enumerate(self.layers):
                lin = linears[li]
                h = h + self.attention(lin, self.normed(layer.input_layernorm, h), li, a)
                h = h + self.mlp(lin, layer, self.normed(layer.post_attention_layernorm, h))
        else:
            h = run_blocks(self, cp, h, a, self.group_executor)
        if logits_for is not None:
            h = h[logits_for]
        return self.head(self.normed(self.norm, h))

    def forward_rows(
        self, tokens: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: KVCache
    ) -> torch.Tensor:
        """``tokens`` ``[T]`` written at rows ``slots`` of ``cache`` with RoPE ``positions``, each
        attending under its row of ``mask`` ``[T, cache.capacity]`` -> logits ``[T, V]``; the
        cache's length is the caller's (``runtime.slots.slot_step``)."""
        return self.steps.rows(tokens, slots, positions, mask, cache)

    def forward_batch(self, parts: Sequence[BatchPart], plan: LayerPlan | None = None) -> list[torch.Tensor]:
        """One forward over several sequences' new rows (continuous batching) -> logits ``[T_i, V]``
        per part, each exactly as :meth:`forward` would run it alone (``StepRunner.batch``)."""
        return self.steps.batch(parts, plan)


# where a linear module keeps the quantised weights a backend reads (``runtime.loading.prepare_backend``)
SOURCE_ATTRS: dict[str, str] = {"int4": "int4_weights", "gguf": "gguf_weights"}


def _source(mod: Any, backend: str) -> Any:
    """Prepared quantised weights of a linear module for ``backend``, if any."""
    return getattr(mod, SOURCE_ATTRS[backend], None) if backend in SOURCE_ATTRS else None


def _layer_linears(
    layer: Any, make: Callable[[torch.Tensor, "torch.Tensor | None", Any], Linear], fuse: bool, backend: str
) -> dict[str, Linear]:
    """A decoder layer's executed projections by name, built by ``make(weight, bias, source)``; with
    ``fuse``, q/k/v and gate/up as one projection each (``runtime.linear.FUSED_PROJECTIONS``) where
    every part has prepared quantised weights or none has (a mix would change some part's kernel)."""
    mods = dict(_projections(layer))
    out: dict[str, Linear] = {}
    for fused, names in FUSED_PROJECTIONS.items() if fuse else ():
        parts = [mods[n] for n in names]
        sources = [_source(m, backend) for m in parts]
        if any(s is None for s in sources) and any(s is not None for s in sources):
            continue
        biases = [getattr(m, "bias", None) for m in parts]
        bias = None if all(b is None for b in biases) else torch.cat([
            b if b is not None else torch.zeros(m.weight.shape[0], dtype=m.weight.dtype) for b, m in zip(biases, parts)
        ])
        source = None if sources[0] is None else type(sources[0]).cat(sources)
        out[fused] = make(torch.cat([m.weight for m in parts]).detach(), bias, source)
        for n in names:
            del mods[n]
    out.update({name: make(mod.weight, mod.bias, _source(mod, backend)) for name, mod in mods.items()})
    return out


def _projections(layer: Any) -> list[tuple[str, Any]]:
    attn, mlp = layer.self_attn, layer.mlp
    return [
        ("q", attn.q_proj), ("k", attn.k_proj), ("v", attn.v_proj), ("o", attn.o_proj),
        ("gate", mlp.gate_proj), ("up", mlp.up_proj), ("down", mlp.down_proj),
    ]
