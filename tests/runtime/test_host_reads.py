"""One host read per round: a decode round (draft, verify, accept, commit) converts device values
to Python at most twice, whatever the drafter does on the device. On a GPU each conversion is a
synchronisation that stalls the launch queue; on the CPU we can count them.

Counted: ``Tensor.item``, ``tolist``, ``__int__``, ``__float__``, ``__bool__`` and ``__index__``,
from the first round to the end of decoding (the prefill's first-token pick is outside the rounds).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from runtime.decoding import Decoder, GenerationConfig
from runtime.drafters import ModelDrafter, SelfDrafter, TreeShape
from runtime.lookup import PromptLookupDrafter
from runtime.sampling import SamplingParams
from runtime.testing import noisy_copy, tiny_model
from runtime.transformer import CausalLM
from search_spaces.layer_plan import LayerPlan

from tests.helpers import Counter, counting

PROMPT = [5, 17, 3, 88, 42, 7, 9, 61, 5, 17, 3]
MAX_READS_PER_ROUND = 2


def _target() -> CausalLM:
    return CausalLM(tiny_model("qwen2", 21, layers=4))


def _draft_model(shape: TreeShape) -> Callable[[], Decoder]:
    def build() -> Decoder:
        target = _target()
        draft = CausalLM(noisy_copy(target.hf_model, 0.3, seed=2))
        drafter = ModelDrafter(draft, target.dims.vocab, shape)
        return Decoder(target, drafter, len(shape.widths), verify_width=shape.max_nodes() + 1)
    return build


def _easyspec() -> Decoder:
    target = _target()
    draft = CausalLM(noisy_copy(target.hf_model, 0.3, seed=2))
    plan = LayerPlan(n_layers=4, groups=((1, 3),))
    drafter = ModelDrafter(draft, target.dims.vocab, TreeShape((1, 1, 1)), plan=plan, calibrate=True)
    return Decoder(target, drafter, 3, verify_width=4)


def _self_draft() -> Decoder:
    target = _target()
    drafter = SelfDrafter(target, LayerPlan(n_layers=4, skip_mlp=(2,)), TreeShape((1, 1, 1)))
    return Decoder(target, drafter, 3, verify_width=4)


def _lookup() -> Decoder:
    return Decoder(_target(), PromptLookupDrafter(max_ngram=3), 4, verify_width=5)


MODES: dict[str, tuple[Callable[[], Decoder], bool]] = {  # name -> (decoder, drafts at depth >= 2)
    "plain": (lambda: Decoder(_target()), False),
    "chain": (_draft_model(TreeShape((1, 1, 1, 1))), True),
    "tree-3-2-1": (_draft_model(TreeShape((3, 2, 1))), True),
    "easyspec-calibrated": (_easyspec, True),
    "self-draft": (_self_draft, True),
    "prompt-lookup": (_lookup, False),
}
SAMPLING = {"greedy": SamplingParams(), "sampled": SamplingParams(temperature=0.8, top_k=40, top_p=0.95)}


def count_reads(decoder: Decoder, params: SamplingParams) -> tuple[int, Any]:
    """Host reads from the first round to the end of a 40-token decode -> (reads, stats)."""
    counter = Counter()

    def start_counting(*_: Any) -> None:
        counter.on = True

    cfg = GenerationConfig(max_new_tokens=40, sampling=params, seed=3)
    with counting(counter), torch.inference_mode():
        result = decoder.generate(PROMPT, cfg, before_round=start_counting)
    return counter.reads, result.stats


@pytest.mark.parametrize("sampling", list(SAMPLING))
@pytest.mark.parametrize("mode", list(MODES))
def test_a_round_reads_the_device_at_most_twice(mode: str, sampling: str) -> None:
    build, deep = MODES[mode]
    decoder = build()
    reads, stats = count_reads(decoder, SAMPLING[sampling])
    rounds = stats.target_forwards - 1
    assert rounds > 0
    if decoder.drafter is not None:
        assert stats.drafted > 0, "nothing was drafted: the rounds counted are plain ones"
    if deep:
        assert max(stats.accept_hist[2:] or [0]) > 0, "no round accepted depth >= 2"
    assert rounds <= reads <= MAX_READS_PER_ROUND * rounds, f"{reads} host reads in {rounds} rounds"


def test_the_counter_sees_a_read_the_round_should_not_make(monkeypatch: pytest.MonkeyPatch) -> None:
    """Power check: a verify that reads its draft back token by token (as the loop did before
    acceptance moved to the device) is caught."""
    import runtime.decoding

    real = runtime.decoding.accept_chain_greedy

    def reads_each_token(argmax: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        _ = [int(t) for t in tokens]
        return real(argmax, tokens)

    monkeypatch.setattr(runtime.decoding, "accept_chain_greedy", reads_each_token)
    decoder = _draft_model(TreeShape((1, 1, 1, 1)))()
    counter = Counter()
    with counting(counter), torch.inference_mode():
        result = decoder.generate(PROMPT, GenerationConfig(max_new_tokens=40), before_round=lambda *_: setattr(counter, "on", True))
    assert counter.reads > MAX_READS_PER_ROUND * (result.stats.target_forwards - 1)


if __name__ == "__main__":  # the table in docs/benchmarks.md: python -m tests.runtime.test_host_reads
    print("| mode | sampling | rounds | reads | reads / round | drafted |\n|---|---|---|---|---|---|")
    for mode, (build, _) in MODES.items():
        for name, params in SAMPLING.items():
            reads, stats = count_reads(build(), params)
            rounds = stats.target_forwards - 1
            print(f"| {mode} | {name} | {rounds} | {reads} | {reads / rounds:.2f} | {stats.drafted} |")

