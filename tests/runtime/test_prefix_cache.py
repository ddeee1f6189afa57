"""Prefix caching across sequences (``runtime.prefix_cache``): a later prompt that starts like an earlier
sequence takes those rows from the cache instead of prefilling them, and decodes exactly what it
decodes without the cache - token for token, greedy and seeded sampling, in every decoding mode, on
models whose rows are reusable (any committed row, the answer's too) and on the others (whole
prefill chunks only). A cache that serves a stale block is caught."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from runtime.decoding import Decoder, GenerationConfig
from runtime.drafters import ModelDrafter, SelfDrafter, TreeShape
from runtime.layout import Layout
from runtime.linear import BACKEND_AVAILABLE
from runtime.lookup import PromptLookupDrafter
from runtime.prefix_cache import PrefixCache
from runtime.sampling import SamplingParams
from runtime.testing import noisy_copy, tiny_model
from runtime.transformer import CausalLM
from search_spaces.layer_plan import LayerPlan
from tests.helpers import StaleCache

REUSABLE = [b for b in ("gguf", "w8a8", "int4") if BACKEND_AVAILABLE[b]()]
# dense keeps whole prefill chunks; the first reusable backend any row (the others share its rule:
# ``test_rows_of_a_reusable_model_are_the_same_however_they_were_computed`` and the quantised tests)
BACKENDS = ["dense", *REUSABLE[:1]]
MODES = ("plain", "chain", "tree", "self-draft", "prompt-lookup")
MiB = 2**20


def _prompt(n: int, seed: int) -> list[int]:
    return [int(t) for t in torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(seed))]


def _target(backend: str) -> CausalLM:
    lm = CausalLM(tiny_model("qwen2", 21, layers=4))
    lm.use_linear_backend(backend)
    return lm


def _decoder(target: CausalLM, mode: str) -> Decoder:
    if mode == "plain":
        return Decoder(target)
    if mode in ("chain", "tree"):
        draft = CausalLM(noisy_copy(target.hf_model, 0.3, seed=2))
        draft.use_linear_backend(target.backend)
        shape = TreeShape((1, 1, 1, 1)) if mode == "chain" else TreeShape((3, 2, 1))
        return Decoder(target, ModelDrafter(draft, target.dims.vocab, shape), len(shape.widths),
                       verify_width=shape.max_nodes() + 1)
    if mode == "self-draft":
        return Decoder(target, SelfDrafter(target, LayerPlan(n_layers=4, skip_mlp=(2,)), TreeShape((1, 1, 1))), 3,
                       verify_width=4)
    return Decoder(target, PromptLookupDrafter(max_ngram=3), 4, verify_width=5)


def _config(temperature: float, chunk: int = 512) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=24, sampling=SamplingParams(temperature=temperature), seed=7,
                            prefill_chunk=chunk)


def _turns(dec: Decoder, cfg: GenerationConfig) -> tuple[list[int], object]:
    """A first request, then a second whose prompt is the first's prompt, its answer and more (a chat's
    next turn) -> the second's tokens and its stats."""
    first = _prompt(70, seed=1)
    a = dec.generate(first, cfg)  # with a prefix cache, its rows are kept
    second = first + a.tokens + _prompt(9, seed=3)
    b = dec.generate(second, cfg)
    return b.tokens, b.stats


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_cached_prefix_decodes_exactly_what_a_fresh_prefill_decodes(backend: str, mode: str,
                                                                      temperature: float) -> None:
    chunk = 512 if backend in REUSABLE else 16  # rows that are not reusable are kept in whole prefill chunks
    cfg = _config(temperature, chunk)
    target = _target(backend)
    plain = _decoder(target, mode)
    want, want_stats = _turns(plain, cfg)
    cached = _decoder(target, mode)
    cached.prefix = PrefixCache(64 * MiB)
    got, stats = _turns(cached, cfg)
    assert got == want
    assert (stats.drafted, stats.accepted) == (want_stats.drafted, want_stats.accepted)  # the draft's rows too
    assert stats.prefix_rows > 0 and want_stats.prefix_rows == 0
    if backend in REUSABLE:  # the first answer's rows were reused as well
        assert stats.prefix_rows > 70
    if mode != "plain" and mode != "prompt-lookup":
        assert stats.drafted > 0


def test_rows_of_a_reusable_model_are_the_same_however_they_were_computed() -> None:
    """What makes any committed row reusable: a prompt's rows from one forward equal the rows of a
    short prefill followed by single steps, bit for bit."""
    if not REUSABLE:
        pytest.skip("no row-invariant backend here")
    lm = _target(REUSABLE[0])
    assert lm.rows_reusable
    prompt = _prompt(60, seed=4)
    a, b = lm.new_cache(80), lm.new_cache(80)
    with torch.inference_mode():
        lm(torch.tensor(prompt), a, Layout.chunk())
        lm(torch.tensor(prompt[:17]), b, Layout.chunk())
        for t in prompt[17:]:
            lm(torch.tensor([t]), b)
    assert torch.equal(a.all_keys[:, :, :60], b.all_keys[:, :, :60])
    assert torch.equal(a.all_values[:, :, :60], b.all_values[:, :, :60])
    assert not _target("dense").rows_reusable  # dense GEMMs: rows depend on the call


@pytest.mark.parametrize("backend", ["dense", *REUSABLE[:1]])
def test_a_cache_that_serves_a_stale_block_is_caught(backend: str) -> None:
    """Power check: the identity above fails for a cache that hands out the wrong rows."""
    chunk = 512 if backend in REUSABLE else 16
    cfg = _config(0.0, chunk)
    target = _target(backend)
    first = _prompt(70, seed=1)
    second = _prompt(70, seed=5)  # no prefix in common
    fresh = Decoder(target).generate(second, cfg).tokens
    for cache in (PrefixCache(64 * MiB), StaleCache(64 * MiB)):
        dec = Decoder(target)
        dec.prefix = cache
        dec.generate(first, cfg)
        got = dec.generate(second, cfg).tokens
        assert (got == fresh) is (type(cache) is PrefixCache)


def test_blocks_are_exact_matches_evicted_least_recent_first_within_the_budget() -> None:
    lm = _target(REUSABLE[0] if REUSABLE else "dense")
    g = PrefixCache(1).granularity(lm, 16)
    block_bytes = 2 * lm.dims.n_layers * lm.dims.n_kv_heads * lm.dims.head_dim * g * 4
    pc = PrefixCache(budget_bytes=3 * block_bytes)
    seqs = [_prompt(2 * g + 1, seed=s) for s in range(3)]
    caches = []
    for toks in seqs:
        c = lm.new_cache(4 * g)
        with torch.inference_mode():
            lm(torch.tensor(toks), c, Layout.chunk())
        caches.append(c)
    assert pc.offer(lm, seqs[0], caches[0], len(seqs[0]), 16) == 2
    assert pc.offer(lm, seqs[1], caches[1], len(seqs[1]), 16) == 2  # 4 blocks > budget: the oldest leaf goes
    st = pc.stats
    assert st.blocks == 3 and st.evictions == 1 and st.used_bytes <= pc.budget_bytes
    into = lm.new_cache(4 * g)
    assert pc.reuse(lm, seqs[0], into, 16, len(seqs[0]) - 1) == g  # its first block is left
    assert torch.equal(into.all_keys[:, :, :g], caches[0].all_keys[:, :, :g])
    into = lm.new_cache(4 * g)
    assert pc.reuse(lm, seqs[1], into, 16, g + 3) == g  # at most the limit, in whole blocks
    into = lm.new_cache(4 * g)
    assert pc.reuse(lm, seqs[2], into, 16, len(seqs[2]) - 1) == 0 and into.length == 0
    st = pc.stats
    assert (st.lookups, st.hits, st.tokens_reused) == (3, 2, 2 * g)
    with pytest.raises(ValueError, match="positive budget"):
        PrefixCache(0)


def test_a_prompt_that_opts_out_neither_reuses_nor_leaves_rows() -> None:
    target = _target(REUSABLE[0] if REUSABLE else "dense")
    dec = Decoder(target)
    dec.prefix = PrefixCache(64 * MiB)
    off = GenerationConfig(max_new_tokens=8, prefill_chunk=16, cache_prompt=False)
    prompt = _prompt(40, seed=8)
    dec.generate(prompt, off)
    assert dec.prefix.stats.blocks == 0
    dec.generate(prompt, GenerationConfig(max_new_tokens=8, prefill_chunk=16))
    assert dec.prefix.stats.blocks > 0
    assert dec.generate(prompt, off).stats.prefix_rows == 0


def test_a_decoder_that_forgets_its_rows_runs_its_draft_over_the_whole_prompt_and_decodes_the_same() -> None:
    """``Decoder.forget_rows`` (a server's cache reset): the draft model keeps none of the last
    sequence's rows, so its catch-up covers the whole prompt again; the tokens do not change."""
    dec = _decoder(_target("dense"), "chain")
    cfg = _config(0.0)
    first = _prompt(70, seed=1)
    second = first + dec.generate(first, cfg).tokens + _prompt(9, seed=3)

    def catch_up() -> int:
        return dec.draft_prefill(dec.start(second, cfg))

    kept = catch_up()  # the draft model kept the first sequence's rows
    dec.forget_rows()
    fresh = catch_up()
    assert kept <= len(second) - len(first) and fresh >= len(second) - 1  # at least the first prompt kept, then none
    assert catch_up() <= 1  # the same prompt again: its rows kept from the sequence before
    # a request that opts out of cached prompts (cache_prompt off) uses no rows of the last sequence,
    # the draft model's own included: its catch-up runs the whole prompt, as after a reset
    off = replace(cfg, cache_prompt=False)
    assert dec.draft_prefill(dec.start(second, off)) >= len(second) - 1
    remembered = dec.generate(second, cfg).tokens
    dec.forget_rows()
    assert dec.generate(second, cfg).tokens == remembered
