"""Compiled steps (``--compile``): every step kind compiles whole (``fullgraph=True``: a graph break
is an error, not a silent eager fallback) and compiled decoding is token-identical to eager
decoding in fp32, for plain decoding, a draft chain, a token tree and an EasySpec plan.

Inductor compiles C++ here, so each graph costs seconds: one module-scoped pair of tiny models
serves every case, and each case compiles only its own new step shapes.
"""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import runtime.compiled
from runtime.decoding import Decoder, GenerationConfig, GenerationResult
from runtime.drafters import ModelDrafter, TreeShape
from runtime.sampling import SamplingParams
from runtime.testing import noisy_copy, tiny_model
from runtime.transformer import CausalLM
from search_spaces.layer_plan import LayerPlan

PROMPT = [5, 17, 3, 88, 42, 7, 9, 61, 5, 17, 3]
N_LAYERS = 4


@pytest.fixture(scope="module")
def weights() -> tuple[torch.nn.Module, torch.nn.Module]:
    target = tiny_model("qwen2", 21, layers=N_LAYERS)
    return target, noisy_copy(target, 0.3, seed=2)


def _plain(target: CausalLM, draft: CausalLM) -> Decoder:
    return Decoder(target)


def _chain(target: CausalLM, draft: CausalLM) -> Decoder:
    return Decoder(target, ModelDrafter(draft, target.dims.vocab, TreeShape((1, 1, 1))), 3, verify_width=4)


TREE = TreeShape((3, 2, 1))


def _tree(target: CausalLM, draft: CausalLM) -> Decoder:
    drafter = ModelDrafter(draft, target.dims.vocab, TREE)
    return Decoder(target, drafter, 3, verify_width=TREE.max_nodes() + 1)


def _easyspec(target: CausalLM, draft: CausalLM) -> Decoder:
    plan = LayerPlan(n_layers=N_LAYERS, groups=((1, 3),))
    drafter = ModelDrafter(draft, target.dims.vocab, TreeShape((1, 1, 1)), plan=plan, calibrate=True)
    return Decoder(target, drafter, 3, verify_width=4)


def _lookup_first(target: CausalLM, draft: CausalLM) -> Decoder:
    """PROMPT ends with the trigram it opens with: the first round checks a lookup copy."""
    return Decoder(target, ModelDrafter(draft, target.dims.vocab, TreeShape((1, 1, 1)), lookup_first=True), 3,
                   verify_width=4)


MODES: dict[str, Callable[[CausalLM, CausalLM], Decoder]] = {
    "plain": _plain, "chain": _chain, "tree-3-2-1": _tree, "easyspec": _easyspec, "lookup-first": _lookup_first,
}


def _decode(weights, build, compiled: bool, params: SamplingParams) -> tuple[GenerationResult, list]:
    target, draft = CausalLM(weights[0]), CausalLM(weights[1])
    if compiled:
        target.compile_steps()
        draft.compile_steps()
    seen_before = set(runtime.compiled._seen)
    cfg = GenerationConfig(max_new_tokens=24, sampling=params, seed=7)
    result = build(target, draft).generate(PROMPT, cfg)
    return result, [k for k in runtime.compiled._seen if k not in seen_before]


@pytest.mark.parametrize("mode", list(MODES))
def test_compiled_decoding_equals_eager(weights, mode):
    build = MODES[mode]
    eager, none = _decode(weights, build, compiled=False, params=SamplingParams())
    assert none == []  # eager decoding compiles nothing
    compiled, graphs = _decode(weights, build, compiled=True, params=SamplingParams())
    assert compiled.tokens == eager.tokens
    assert compiled.stats.accepted == eager.stats.accepted
    widths = sorted({key[1] for key in graphs})
    if mode == "plain":
        assert widths == [1]
    else:  # speculation happened, through compiled verify and draft steps
        assert compiled.stats.drafted > 0 and max(compiled.stats.accept_hist[2:] or [0]) > 0
        assert TREE.max_nodes() + 1 in widths if mode == "tree-3-2-1" else 4 in widths
        assert 1 in widths or mode == "tree-3-2-1"
        if mode == "lookup-first":  # the checked copy's catch-up: padded to twice the draft length + 1
            assert 8 in widths, widths


def test_compiled_sampling_equals_eager_sampling(weights):
    """Same seed, same draws: the compiled chain samples exactly what eager decoding samples."""
    params = SamplingParams(temperature=0.8)
    eager, _ = _decode(weights, _chain, compiled=False, params=params)
    compiled, _ = _decode(weights, _chain, compiled=True, params=params)
    assert compiled.tokens == eager.tokens
    assert compiled.stats.drafted > 0


def test_compile_refuses_opaque_linear_backends(weights):
    draft = CausalLM(weights[1])
    draft.use_linear_backend("int8")
    with pytest.raises(Exception, match="dense linear backend"):
        draft.compile_steps()


def test_compiled_cuda_steps_reuse_one_static_cache_per_capacity(weights):
    """Compiled CUDA steps write a cache their CUDA graphs hold by address: ``new_cache`` hands a
    compiled CUDA wrapper's sequences the same cache again per capacity, emptied, its tensors
    marked static (unguarded, so a new address re-records rather than recompiles); any other
    caller (a cost model timing a forward mid-decode) gets a new static cache, never the live
    sequence's. A cache allocated per request made inductor skip CUDA graphs for every step on an
    H200 ("mutated inputs")."""
    lm = CausalLM(weights[0])
    first = lm._static_cache(256, reuse=True)
    first.advance(5)
    again = lm._static_cache(256, reuse=True)
    assert again is first and again.length == 0
    assert lm._static_cache(512, reuse=True) is not first
    again.advance(5)
    scratch = lm._static_cache(256, reuse=False)
    assert scratch is not first and first.length == 5  # the live sequence's cache is untouched
    for t in (first.all_keys, first.all_values, scratch.all_keys, scratch.all_values):
        assert getattr(t, "_dynamo_static_input_type", None) == "unguarded"
    lm.compile_steps()  # on the CPU a compiled wrapper still gets a fresh cache each time
    assert lm.new_cache(10, reuse=True) is not lm.new_cache(10, reuse=True)


def test_compiled_steps_run_under_the_raised_recompile_limits_in_any_thread():
    """torch keeps a dynamo config set in code per thread: a server compiles at start-up in one
    thread and decodes in another, where the default limit (8 graphs of ``_step``) failed a
    request once several strategies had compiled. ``run_step`` raises the limits in the thread it
    runs in (the step here records what its thread sees)."""
    import threading

    seen: list[tuple[int, bool]] = []

    def step() -> torch.Tensor:
        cfg = torch._dynamo.config
        seen.append((cfg.recompile_limit, cfg.fail_on_recompile_limit_hit))
        return torch.zeros(1)

    def fresh_thread() -> None:
        seen.append((torch._dynamo.config.recompile_limit, torch._dynamo.config.fail_on_recompile_limit_hit))
        runtime.compiled.run_step(step, torch.device("cpu"))

    runtime.compiled.allow_recompiles()  # as compile_step does, in this thread
    worker = threading.Thread(target=fresh_thread)
    worker.start()
    worker.join()
    assert seen[1] == (runtime.compiled.RECOMPILE_LIMIT, True)  # (seen[0]: 8 and False on torch 2.13)
