"""One host read per round: a decode round (draft, verify, accept, commit) converts device values
to Python at most twice, whatever the drafter does on the device. On a GPU each conversion is a
synchronisation that stalls the launch queue; on the CPU we can count them.

Counted: ``Tensor.item``, ``tolist``, ``__int__``, ``__float__``, ``__bool__`` and ``__index__``,
from the first round to the end of decoding (the prefill's first-token pick is outside the rounds).

A batched step (``runtime.batching.batch_round``: every sequence drafts, one target forward verifies
them all, each accepts by its own rules) holds to the same bound at any batch size: its verdicts
come back in one read for the whole batch.
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


def _draft_model(shape: TreeShape) -> Callable[[CausalLM], Decoder]:
    def build(target: CausalLM) -> Decoder:
        draft = CausalLM(noisy_copy(target.hf_model, 0.3, seed=2))
        drafter = ModelDrafter(draft, target.dims.vocab, shape)
        return Decoder(target, drafter, len(shape.widths), verify_width=shape.max_nodes() + 1)
    return build


def _easyspec(target: CausalLM) -> Decoder:
    draft = CausalLM(noisy_copy(target.hf_model, 0.3, seed=2))
    plan = LayerPlan(n_layers=4, groups=((1, 3),))
    drafter = ModelDrafter(draft, target.dims.vocab, TreeShape((1, 1, 1)), plan=plan, calibrate=True)
    return Decoder(target, drafter, 3, verify_width=4)


def _self_draft(target: CausalLM) -> Decoder:
    drafter = SelfDrafter(target, LayerPlan(n_layers=4, skip_mlp=(2,)), TreeShape((1, 1, 1)))
    return Decoder(target, drafter, 3, verify_width=4)


def _lookup(target: CausalLM) -> Decoder:
    return Decoder(target, PromptLookupDrafter(max_ngram=3), 4, verify_width=5)


MODES: dict[str, tuple[Callable[[CausalLM], Decoder], bool]] = {  # name -> (decoder on a target, drafts at depth >= 2)
    "plain": (Decoder, False),
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
    decoder = build(_target())
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
    decoder = _draft_model(TreeShape((1, 1, 1, 1)))(_target())
    counter = Counter()
    with counting(counter), torch.inference_mode():
        result = decoder.generate(PROMPT, GenerationConfig(max_new_tokens=40), before_round=lambda *_: setattr(counter, "on", True))
    assert counter.reads > MAX_READS_PER_ROUND * (result.stats.target_forwards - 1)



def count_batch_reads(names: list[str], params: SamplingParams, steps: int = 12) -> tuple[list[int], list[Any]]:
    """Host reads of each batched step (``runtime.batching.batch_round``) over ``steps`` steps of
    sequences decoded together on one target, sequence i with mode ``names[i]`` -> (reads per
    step, each sequence's stats)."""
    from runtime.batching import Member, batch_round

    target = _target()
    members = []
    for i, name in enumerate(names):
        decoder = MODES[name][0](target)
        seq = decoder.start(PROMPT[i % 3 :], GenerationConfig(max_new_tokens=60, sampling=params, seed=3 + i))
        decoder.draft_prefill(seq)
        members.append(Member(decoder, seq))
    per_step = []
    for _ in range(steps):
        counter = Counter()
        counter.on = True
        with counting(counter), torch.inference_mode():
            batch_round(target, members)
        per_step.append(counter.reads)
    return per_step, [m.seq.stats for m in members]


@pytest.mark.parametrize("sampling", list(SAMPLING))
@pytest.mark.parametrize("size", [2, 6])
def test_a_batched_step_reads_the_device_at_most_twice(size: int, sampling: str) -> None:
    """A step of several sequences (each its own strategy: every mode above, in turn) reads the
    device at most twice, whatever the batch's size."""
    names = [list(MODES)[i % len(MODES)] for i in range(size)]
    per_step, stats = count_batch_reads(names, SAMPLING[sampling])
    for name, st in zip(names, stats):
        if MODES[name][1]:  # the model drafters draft every step; lookup only when its n-gram recurs
            assert st.drafted > 0, f"{name} drafted nothing in the batch"
    assert sum(st.drafted for st in stats) > 0
    assert 1 <= min(per_step) and max(per_step) <= MAX_READS_PER_ROUND, f"host reads per batched step: {per_step}"


def test_the_counter_sees_a_batched_step_that_reads_per_sequence(monkeypatch: pytest.MonkeyPatch) -> None:
    """Power check: a step that reads each sequence's verdict back on its own is caught."""
    real = Decoder.judge

    def read_each(*args: Any) -> torch.Tensor:
        verdict = real(*args)
        verdict.tolist()
        return verdict

    monkeypatch.setattr(Decoder, "judge", staticmethod(read_each))
    per_step, _ = count_batch_reads(["plain", "chain", "prompt-lookup"], SAMPLING["greedy"], steps=3)
    assert min(per_step) > MAX_READS_PER_ROUND


if __name__ == "__main__":  # the table in docs/benchmarks.md: python -m tests.runtime.test_host_reads
    print("| mode | sampling | rounds | reads | reads / round | drafted |\n|---|---|---|---|---|---|")
    for mode, (build, _) in MODES.items():
        for name, params in SAMPLING.items():
            reads, stats = count_reads(build(_target()), params)
            rounds = stats.target_forwards - 1
            print(f"| {mode} | {name} | {rounds} | {reads} | {reads / rounds:.2f} | {stats.drafted} |")

