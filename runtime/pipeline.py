"""Build decoders from a Strategy: load (and cache) models, wrap them, build the drafter of its
kind (this module attaches each built-in kind's ``build`` part, ``search_spaces.kinds``)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from runtime.decoding import Decoder
from runtime.draft import Drafter
from runtime.draft_shapes import tree_shape
from runtime.drafters import ModelDrafter, SelfDrafter
from runtime.errors import RuntimeUserError
from runtime.layer_exec import check_plan_fits
from runtime.linear import mkl_packing_available
from runtime.loading import (
    LoadedModel, as_precision, at_precision, check_vocab_compatible, load_model, loads_blocks_only, prepare_backend,
    random_model,
)
from runtime.lookup import PromptLookupDrafter
from runtime.precision import PRECISIONS, draft_precision
from runtime.transformer import CausalLM
from search_spaces.kinds import DRAFT_MODEL, LAYER_SKIP, NONE, PROMPT_LOOKUP, attach, kind_of
from search_spaces.strategy import PLAIN, Strategy


@dataclass
class ModelPool:
    """Loads each (model, dtype) once and keeps it; strategies swap without reloading.

    ``compile``: a runtime option independent of any strategy: every decoder built from this pool
    runs its steps compiled (``torch.compile(fullgraph=True)``, CUDA graphs on CUDA; see
    ``runtime.compiled``), with dense weights (no packed or int8 GEMMs)."""

    device: str = "cpu"
    compile: bool = False
    random_weights: bool = False  # build models from their configs with seeded random weights (costs only)
    _models: dict[tuple[str, str], LoadedModel] = field(default_factory=dict)  # by (name, precision)
    _trees: dict[tuple[str, torch.dtype], LoadedModel] = field(default_factory=dict)  # loaded once per dtype
    # target wrappers whose weights were repacked, by (model, backend, width): one copy each
    _prepared: dict[tuple[int, str, int | None], CausalLM] = field(default_factory=dict)

    def target_for_width(self, target: LoadedModel, backend: str, width: int) -> CausalLM:
        """A wrapper of ``target`` executing with ``backend`` packed for ``width`` rows (shared)."""
        key = (id(target.hf_model), backend, width)
        if key not in self._prepared:
            prepare_backend(target, backend)
            lm = CausalLM(target.hf_model)
            lm.use_linear_backend(backend, width)
            self._prepared[key] = lm
        shared = CausalLM(target.hf_model)
        shared.share_linears_from(self._prepared[key])
        return shared

    def draft_wrapper(self, draft: LoadedModel, backend: str, draft_vocab: int | None, target_vocab: int) -> CausalLM:
        """A wrapper of ``draft`` running ``backend`` with its head cut to the shared vocabulary
        (or ``draft_vocab``); the converted weights are made once and shared between decoders."""
        full = draft.hf_model.lm_head.weight.shape[0]
        head = min(draft_vocab or full, target_vocab, full)
        key = (id(draft.hf_model), f"draft-{backend}", head)
        if key not in self._prepared:
            prepare_backend(draft, backend)
            lm = CausalLM(draft.hf_model)
            lm.restrict_head(head)
            lm.use_linear_backend(backend, draft=True)
            self._prepared[key] = lm
        shared = CausalLM(draft.hf_model)
        shared.share_linears_from(self._prepared[key])
        return shared

    def get(self, name: str, precision: str | torch.dtype) -> LoadedModel:
        """``name`` at ``precision`` (a name, ``auto`` or a torch float dtype). Precisions that
        load the same dtype share one module tree (int4 and float32 both read float32 weights); a
        packaged GGUF model at ``gguf`` has its own, built from the file's blocks alone."""
        prec = as_precision(precision, self.device)
        key = (name, prec.name)
        if key not in self._models:
            if not self.random_weights and loads_blocks_only(name, prec):  # no float tree to share
                self._models[key] = load_model(name, prec.name, self.device)
                return self._models[key]
            tree_key = (name, prec.load_dtype)
            if tree_key not in self._trees:
                load = random_model if self.random_weights else load_model
                self._trees[tree_key] = load(name, prec.load_dtype, self.device)
            self._models[key] = at_precision(self._trees[tree_key], prec)
        return self._models[key]

    def served(self, target: LoadedModel) -> CausalLM:
        """A wrapper of ``target`` running its precision's linear backend at every width (the
        quantised weights made once and shared; float32 on the CPU: ``float32_cpu_backend``, oneDNN's
        row-invariant GEMMs unless pinned to dense; other float precisions: a fresh dense wrapper)."""
        backend = PRECISIONS[target.precision].backend_on(self.device, self.compile)
        if backend == "dense":
            return CausalLM(target.hf_model)
        if self.compile:
            raise RuntimeUserError(
                f"precision {target.precision} cannot be compiled (its GEMMs are opaque to torch.compile); "
                "use --precision float32 or bfloat16 with --compile"
            )
        return self.target_for_width(target, backend, 1)


DrafterFactory = Callable[[ModelPool, LoadedModel, "str | None", Strategy, CausalLM], "Drafter | None"]


def _no_drafter(pool: ModelPool, target: LoadedModel, draft_name: str | None, s: Strategy, lm: CausalLM) -> None:
    return None


def _model_drafter(
    pool: ModelPool, target: LoadedModel, draft_name: str | None, s: Strategy, lm: CausalLM
) -> Drafter:
    if draft_name is None:
        raise RuntimeUserError("strategy drafter 'draft-model' needs a draft model; pass --draft MODEL")
    precision = draft_precision(s.draft_precision, pool.device, pool.compile)
    draft = pool.get(draft_name, precision.name)
    check_vocab_compatible(target, draft)
    draft_lm = pool.draft_wrapper(draft, precision.backend, s.draft_vocab, lm.dims.vocab)
    if s.layer_plan is not None:
        check_plan_fits(s.layer_plan, draft_lm.dims.n_layers, f"draft model {draft_name}")
    if pool.compile:
        draft_lm.compile_steps()
    return ModelDrafter(
        draft_lm, target_vocab=lm.dims.vocab, shape=tree_shape(s), plan=s.layer_plan, calibrate=s.calibrate,
        lookup_first=s.lookup_first,
    )


def _self_drafter(
    pool: ModelPool, target: LoadedModel, draft_name: str | None, s: Strategy, lm: CausalLM
) -> Drafter:
    """SWIFT self-speculation: the target with the strategy's layer plan (skips) drafts."""
    if draft_name is not None:
        raise RuntimeUserError("strategy drafter 'layer-skip' drafts with the target itself; drop --draft")
    assert s.layer_plan is not None  # Strategy validation guarantees it
    check_plan_fits(s.layer_plan, lm.dims.n_layers, f"target model {target.model_id}")
    return SelfDrafter(lm, s.layer_plan, shape=tree_shape(s))


def draft_load_precision(strategy: Strategy, device: str, compiled: bool = False) -> str:
    """The precision name the strategy's draft model is loaded at (``ModelPool.get``)."""
    return draft_precision(strategy.draft_precision, device, compiled).name


def default_draft(pool: ModelPool, name: str) -> LoadedModel:
    """Draft model ``name`` as strategies draft with it by default (``draft_precision`` auto): what a
    caller reads its config and vocabulary from, without loading a second tree of it."""
    return pool.get(name, draft_load_precision(PLAIN, pool.device, pool.compile))


def verify_backend(device: str) -> str:
    """On CPU, pack the target's float32 weights for the verify width (see runtime.linear)."""
    return "mkl-packed" if torch.device(device).type == "cpu" and mkl_packing_available() else "dense"


def verify_packing(lm: CausalLM, device: str, compiled: bool = False) -> str | None:
    """The backend a served target's verifies run on a copy of its weights packed for the verify
    width (``ModelPool.target_for_width``): ``mkl-packed`` for a float32 target on MKL's dense kernel,
    on a CPU, uncompiled; None where verifies run the served wrapper itself (a quantised or oneDNN
    backend is row-invariant already, compiled steps have static shapes, a GPU packs nothing)."""
    backend = verify_backend(device)
    if backend != "dense" and lm.backend == "dense" and lm.dtype == torch.float32 and not compiled:
        return backend
    return None


def _lookup_drafter(
    pool: ModelPool, target: LoadedModel, draft_name: str | None, s: Strategy, lm: CausalLM
) -> Drafter:
    return PromptLookupDrafter()


attach(NONE, build=_no_drafter)
attach(DRAFT_MODEL, build=_model_drafter)
attach(LAYER_SKIP, build=_self_drafter)
attach(PROMPT_LOOKUP, build=_lookup_drafter)


def build_drafter(
    pool: ModelPool, target: LoadedModel, draft_name: str | None, s: Strategy, lm: CausalLM
) -> Drafter | None:
    """The drafter of ``s``'s kind (None for plain decoding), by the kind's ``build`` part."""
    factory: DrafterFactory = kind_of(s.drafter).part("build")
    return factory(pool, target, draft_name, s, lm)


def build_decoder(
    pool: ModelPool, target: LoadedModel, strategy: Strategy, draft_name: str | None = None,
    verify_width: int | None = None, standby: Sequence[Strategy] = (),
) -> Decoder:
    """A decoder for ``strategy``. ``verify_width`` fixes the padded verify width (the tuner keeps
    one width, hence one packed copy of the target, for every strategy it tries). ``standby``:
    strategies of other drafter kinds whose drafters the decoder keeps following the sequence,
    so that ``Decoder.apply`` can switch to them while decoding (the online tuner's joint space)."""
    lm = pool.served(target)
    drafter = build_drafter(pool, target, draft_name, strategy, lm)
    if drafter is None and not standby:  # plain decoding: single-token steps on the unpacked weights
        return Decoder(_compiled(lm, pool))
    nodes = max(s.max_tree_nodes for s in (strategy, *standby) if s.speculates)  # plain decoding drafts none
    width = verify_width or nodes + 1
    if width < nodes + 1:
        raise RuntimeUserError(f"verify width {width} is too small for a strategy with {nodes} draft nodes")
    # drafters run on the unpacked wrapper (a self-drafter's single-row steps; it shares the cache)
    first = strategy if drafter is not None else next(s for s in standby if s.speculates)
    active = drafter if drafter is not None else build_drafter(pool, target, draft_name, first, lm)
    waiting = {s.drafter: s for s in standby if s.speculates and s.drafter != first.drafter}
    others = {kind: build_drafter(pool, target, draft_name, s, lm) for kind, s in waiting.items()}
    backend = verify_packing(lm, pool.device, pool.compile)
    packed = backend is not None
    if packed:
        lm = pool.target_for_width(target, backend, width)
    decoder = Decoder(_compiled(lm, pool), active, first.draft_length, verify_width=width, kind=first.drafter)
    decoder.pads = packed or pool.compile  # otherwise a verify runs its drafted rows only
    decoder.standby.update(others)
    if drafter is None:  # plain decoding first, the others on standby
        decoder.apply(strategy)
    return decoder


def _compiled(lm: CausalLM, pool: ModelPool) -> CausalLM:
    if pool.compile:
        lm.compile_steps()
    return lm


def eos_ids(model: LoadedModel) -> tuple[int, ...]:
    """EOS ids exactly as HF ``generate`` uses them (generation_config first, then tokenizer)."""
    eos = getattr(model.hf_model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = model.tokenizer.eos_token_id
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
