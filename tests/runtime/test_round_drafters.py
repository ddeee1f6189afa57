"""A drafting model's round drafters (``runtime.chain_drafting``, ``runtime.tree_drafting``,
``runtime.lookup_first``): which one proposes a round, that a chain with a confidence threshold
drafts through the chain's own loop the tokens the tree code's confidence-aware path drafts for a
width-1 shape, and that lookup-first on a tree takes the copy alone."""
from __future__ import annotations

import torch

from runtime.chain_drafting import ChainDrafter
from runtime.decoding import Decoder, GenerationConfig
from runtime.draft_shapes import TreeShape
from runtime.drafters import ModelDrafter
from runtime.lookup_first import LookupFirst
from runtime.sampling import SamplingParams
from runtime.testing import noisy_copy, tiny_model
from runtime.transformer import CausalLM
from runtime.tree_drafting import TreeDrafter

PROMPT = [5, 17, 3, 88, 42, 7, 9, 61, 5, 17, 3]
THRESHOLD_CHAIN = TreeShape((1, 1, 1, 1, 1), threshold=0.1)


def _drafters(shape: TreeShape, lookup_first: bool = False) -> tuple[CausalLM, ModelDrafter]:
    target = tiny_model("qwen2", 40)
    draft = CausalLM(noisy_copy(target, 0.4, seed=5))
    return CausalLM(target), ModelDrafter(draft, 96, shape, lookup_first=lookup_first)


def test_the_round_drafter_follows_the_rounds_shape_and_lookup_first():
    _, d = _drafters(TreeShape((2, 1)))
    assert isinstance(d._round_drafter(TreeShape((2, 1))), TreeDrafter)
    assert isinstance(d._round_drafter(TreeShape((2, 1)).narrowed(1)), ChainDrafter)  # a tree narrowed for load
    assert isinstance(d._round_drafter(TreeShape((1, 1), dynamic=((1.0, 2),))), TreeDrafter)
    d.lookup_first = True
    picked = d._round_drafter(TreeShape((1, 1, 1)))
    assert isinstance(picked, LookupFirst) and picked.inner is d.chain


def test_a_threshold_chain_drafts_what_the_tree_codes_adaptive_path_drafts():
    """Greedy, round after round on the same decode: the chain's loop and the tree drafter's
    confidence-aware path (forced) propose the same tokens, stop at the same depths and leave the
    draft's cache the same. Power: the threshold stops some rounds early, so the stop is compared."""
    target, chain_side = _drafters(THRESHOLD_CHAIN)
    _, tree_side = _drafters(THRESHOLD_CHAIN)
    tree_side._round_drafter = lambda shape: tree_side.tree  # type: ignore[method-assign]
    chain_dec = Decoder(target, chain_side, 5, verify_width=6)
    tree_dec = Decoder(target, tree_side, 5, verify_width=6)
    proposals: dict[str, list[list[int]]] = {"chain": [], "tree": []}
    for name, drafter in (("chain", chain_side), ("tree", tree_side)):
        steps = drafter.propose_steps

        def recording(k, params, gen, steps=steps, name=name):
            draft = yield from steps(k, params, gen)
            proposals[name].append(draft.tokens.tolist())
            return draft

        drafter.propose_steps = recording  # type: ignore[method-assign]
    cfg = GenerationConfig(max_new_tokens=40)
    a, b = chain_dec.generate(PROMPT, cfg), tree_dec.generate(PROMPT, cfg)
    assert a.tokens == b.tokens == Decoder(target).generate(PROMPT, cfg).tokens
    assert proposals["chain"] == proposals["tree"] and len(proposals["chain"]) > 3
    lengths = {len(p) for p in proposals["chain"]}
    assert len(lengths) > 1 and max(lengths) >= 2  # the threshold cut some rounds short; others went deep
    n = chain_side.cache.length
    assert n == tree_side.cache.length
    assert torch.allclose(chain_side.cache.all_keys[:, :, :n], tree_side.cache.all_keys[:, :, :n])


def test_lookup_first_on_a_tree_takes_the_copy_alone():
    """Where the prompt recurs, a tree's round is the lookup copy: no draft forward, q=None."""
    target, drafter = _drafters(TreeShape((2, 2, 1)), lookup_first=True)
    drafter.begin(PROMPT, 64)
    steps = drafter.propose_steps(3, SamplingParams(), torch.Generator().manual_seed(0))
    try:
        first = next(steps)
        raise AssertionError(f"the model drafted ({type(first).__name__}) where the copy should stand alone")
    except StopIteration as done:
        draft = done.value
    assert draft.tokens.tolist() == [88, 42, 7] and draft.q is None  # PROMPT's continuation after 5, 17, 3
    assert drafter.lookup_rounds == 1 and drafter.copied_kept == 0
