"""Shared batching cases: a few prompts and one decoder builder per strategy kind over one tiny
target, used by the batching and prompt-rider tests."""
from __future__ import annotations

from collections.abc import Callable

from runtime.decoding import Decoder
from runtime.drafters import ModelDrafter, SelfDrafter, TreeShape
from runtime.lookup import PromptLookupDrafter
from runtime.testing import noisy_copy, tiny_model
from runtime.transformer import CausalLM
from search_spaces.layer_plan import LayerPlan


PROMPTS = [
    [5, 17, 3, 88, 42, 7, 9, 61, 5, 17, 3],
    [12, 9, 40, 40, 2],
    [7, 7, 30, 1, 2, 3, 7, 7, 30, 1, 2, 3, 7],
    [90, 4, 18],
    [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5],
]


def decoders(backend: str = "dense") -> dict[str, Callable[[], Decoder]]:
    """One builder per strategy kind, all over the same target weights (a seeded tiny qwen2)."""
    model = tiny_model("qwen2", 21, layers=4)
    draft = noisy_copy(model, 0.3, seed=2)
    shared_draft = CausalLM(draft)  # drafters share its projections, as a ModelPool's do: they draft together

    def draft_lm() -> CausalLM:
        lm = CausalLM(draft)
        lm.share_linears_from(shared_draft)
        return lm

    def target() -> CausalLM:
        lm = CausalLM(model)
        lm.use_linear_backend(backend)
        return lm

    def with_draft(shape: TreeShape) -> Callable[[], Decoder]:
        def build() -> Decoder:
            t = target()
            return Decoder(t, ModelDrafter(draft_lm(), t.dims.vocab, shape), len(shape.widths),
                           verify_width=shape.max_nodes() + 1)
        return build

    def self_draft() -> Decoder:
        t = target()
        return Decoder(t, SelfDrafter(t, LayerPlan(n_layers=4, skip_mlp=(2,)), TreeShape((1, 1, 1))), 3, verify_width=4)

    return {
        "plain": lambda: Decoder(target()),
        "chain": with_draft(TreeShape((1, 1, 1, 1))),
        "tree-3-2-1": with_draft(TreeShape((3, 2, 1))),
        "lookup": lambda: Decoder(target(), PromptLookupDrafter(max_ngram=3), 4, verify_width=5),
        "self-draft": self_draft,
    }
