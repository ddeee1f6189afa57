"""A prompt's chunks ride in a running batch's target forward (``batch_round(..., riders)``) on a
target whose rows are reusable: the prompt's cache rows come out bit for bit as its lone prefill's,
and every sequence, the riding one and its batch-mates, decodes exactly what it decodes alone
(greedy and seeded sampling, every decoding mode). A rider computed at the wrong positions is
caught, and a target whose rows are not reusable refuses riders."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from runtime.batching import Member, Rider, batch_round
from runtime.decoding import Decoder, GenerationConfig
from runtime.linear import BACKEND_AVAILABLE
from runtime.sampling import SamplingParams
from tests.runtime.batch_cases import PROMPTS, decoders as _decoders

# the serving defaults whose rows are reusable: gguf (auto on the CPU) and oneDNN's float32
REUSABLE = [b for b in ("gguf", "onednn") if BACKEND_AVAILABLE[b]()]
LONG = [int(t) for t in torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(3))]
CHUNK = 7  # 40 prompt tokens: 6 chunks, each riding one round


def _config(sampling: str, seed: int, chunk: int = CHUNK) -> GenerationConfig:
    params = SamplingParams() if sampling == "greedy" else SamplingParams(temperature=0.8, top_k=40)
    return GenerationConfig(max_new_tokens=32, sampling=params, seed=seed, prefill_chunk=chunk)


def _ride(target, members: list[Member], dec: Decoder, prompt: list[int], cfg: GenerationConfig, shift: int = 0):
    """Start ``prompt`` on ``dec`` with every chunk riding one round of ``members`` (``shift``: the
    chunk's positions moved, the power check's wrong rider) -> (its sequence, rounds ridden)."""
    steps = dec.start_steps(prompt, cfg)
    chunk, rides = next(steps), 0
    while True:
        part = chunk.part if not shift else replace(
            chunk.part, positions=torch.arange(chunk.rows) + chunk.part.cache.length + shift)
        rider = Rider(replace(chunk, part=part))
        batch_round(target, members, [rider])
        rides += 1
        assert rider.logits is not None and rider.logits.shape[0] == 1 and rider.seconds > 0
        try:
            chunk = steps.send((rider.logits, rider.seconds))
        except StopIteration as done:
            return done.value, rides


def _finish(target, members: list[Member]) -> None:
    while live := [m for m in members if not m.seq.finished]:
        batch_round(target, live)


@pytest.mark.parametrize("backend", REUSABLE or ["none"])
@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
def test_prompt_chunks_riding_a_batch_decode_as_alone(backend, sampling):
    if not REUSABLE:
        pytest.skip("no row-invariant backend here")
    builders = _decoders(backend)
    for name, build in builders.items():
        mate_cfg, cfg = _config(sampling, 1), _config(sampling, 2)
        mate_alone = build().generate(PROMPTS[0], mate_cfg)
        alone_dec = build()
        alone = alone_dec.generate(LONG, cfg)
        solo = build().start(LONG, cfg)  # the lone prefill's cache rows

        mate = build()
        target = mate.target
        assert target.rows_reusable
        members = [Member(mate, mate.start(PROMPTS[0], mate_cfg))]
        dec = build()
        seq, rides = _ride(target, members, dec, LONG, cfg)
        assert rides == 6, name
        n = len(LONG)
        assert torch.equal(seq.cache.all_keys[:, :, :n], solo.cache.all_keys[:, :, :n]), name
        assert torch.equal(seq.cache.all_values[:, :, :n], solo.cache.all_values[:, :, :n]), name
        assert seq.out == solo.out, name
        dec.draft_prefill(seq)
        members.append(Member(dec, seq))
        _finish(target, members)
        assert members[0].seq.result().tokens == mate_alone.tokens, name
        assert seq.result().tokens == alone.tokens, name
        if name != "plain":
            assert seq.stats.drafted > 0 and members[0].seq.stats.drafted > 0, name


def test_a_rider_at_the_wrong_positions_is_caught():
    """Power check: a chunk whose rows ride at shifted positions leaves other cache rows and tokens."""
    if not REUSABLE:
        pytest.skip("no row-invariant backend here")
    build = _decoders(REUSABLE[0])["plain"]
    cfg = _config("greedy", 0)
    solo = build().start(LONG, cfg)
    mate = build()
    members = [Member(mate, mate.start(PROMPTS[0], cfg))]
    seq, _ = _ride(mate.target, members, build(), LONG, cfg, shift=1)
    assert not torch.equal(seq.cache.all_keys[:, :, : len(LONG)], solo.cache.all_keys[:, :, : len(LONG)])


def test_a_target_whose_rows_are_not_reusable_refuses_riders():
    build = _decoders("dense")["plain"]
    mate, dec = build(), build()
    assert not mate.target.rows_reusable
    members = [Member(mate, mate.start(PROMPTS[0], _config("greedy", 0)))]
    chunk = next(dec.start_steps(LONG, _config("greedy", 0)))
    with pytest.raises(ValueError, match="reusable"):
        batch_round(mate.target, members, [Rider(chunk)])
