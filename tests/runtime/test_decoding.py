"""The decode loop itself: stopping at an EOS inside an accepted run, consistent stats, and the
random generator living on the decode device."""
from __future__ import annotations

import pytest
import torch

import runtime.decoding as decoding
from runtime.decoding import Decoder, GenerationConfig
from runtime.sequence import decode_generator
from runtime.drafters import ModelDrafter, TreeShape
from runtime.lookup import PromptLookupDrafter
from runtime.sampling import SamplingParams
from runtime.testing import tiny_model
from runtime.transformer import CausalLM

PROMPT = [5, 17, 3, 88, 42, 7]


def self_draft_decoder(hf, k: int, shape: TreeShape | None = None) -> Decoder:
    """The target drafting for itself through its own cache: every draft is accepted (greedy)."""
    shape = shape or TreeShape((1,) * k)
    target, draft = CausalLM(hf), CausalLM(hf)
    return Decoder(target, ModelDrafter(draft, target.dims.vocab, shape), len(shape.widths), shape.max_nodes() + 1)


def check_stats_match_tokens(tokens: list[int], stats) -> None:
    """Every returned token is the prefill's, an accepted draft, or one target token per round."""
    assert stats.new_tokens == len(tokens)
    rounds = stats.target_forwards - 1
    assert stats.accepted == sum(i * n for i, n in enumerate(stats.accept_hist))
    # each round returns its accepted drafts plus the target's token, except a round cut at an EOS draft
    assert stats.accepted + rounds <= len(tokens) <= stats.accepted + rounds + 1
    assert stats.mean_accepted == pytest.approx(len(tokens) / stats.target_forwards)


@pytest.mark.parametrize("shape", [None, TreeShape((2, 2, 1, 1))], ids=["chain", "tree"])
def test_eos_accepted_mid_round_stops_decoding(tiny_llama, shape):
    """An EOS accepted in the middle of a round ends the decode there: no further rounds, and the
    stats describe exactly the returned tokens."""
    plain = Decoder(CausalLM(tiny_llama)).generate(PROMPT, GenerationConfig(max_new_tokens=40)).tokens
    k = 4
    # round r >= 1 returns plain[1 + 5(r-1) : 1 + 5r]: k accepted drafts, then the bonus token;
    # take as EOS a token that first occurs as a draft (not the bonus) after round 1
    index = next(i for i in range(6, 40) if (i - 1) % (k + 1) < k and plain[i] not in plain[:i])
    rounds, position = (index - 1) // (k + 1) + 1, (index - 1) % (k + 1)
    eos = plain[index]
    cfg = GenerationConfig(max_new_tokens=40, eos_token_ids=(eos,))
    got = self_draft_decoder(tiny_llama, k, shape).generate(PROMPT, cfg)
    assert got.tokens == plain[: index + 1]
    assert got.stats.target_forwards == 1 + rounds  # nothing decoded past the EOS
    assert got.stats.drafted > 0 and got.stats.accept_hist[k] == rounds - 1  # earlier rounds accepted all
    assert got.stats.accepted == k * (rounds - 1) + position + 1  # the last round counts drafts up to the EOS
    # drafts deeper than the EOS are neither accepted nor counted as drafted: every position the
    # stats saw drafted was accepted (a self-draft), and a chain's alpha stays 1
    assert got.stats.position_accepted == got.stats.position_drafted
    assert shape is not None or got.stats.drafted == got.stats.accepted
    check_stats_match_tokens(got.tokens, got.stats)


def test_eos_as_bonus_token_and_plain_decoding(tiny_qwen):
    plain = Decoder(CausalLM(tiny_qwen)).generate(PROMPT, GenerationConfig(max_new_tokens=30)).tokens
    eos = next(t for i, t in enumerate(plain) if i >= 5 and t not in plain[:i])
    cfg = GenerationConfig(max_new_tokens=30, eos_token_ids=(eos,))
    want = plain[: plain.index(eos) + 1]
    for decoder in (Decoder(CausalLM(tiny_qwen)), self_draft_decoder(tiny_qwen, 3)):
        got = decoder.generate(PROMPT, cfg)
        assert got.tokens == want
        check_stats_match_tokens(got.tokens, got.stats)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_stats_consistent_under_sampling_and_lookup(tiny_llama, temperature):
    """Whatever the outcome of each round, the stats add up to the returned tokens."""
    params = SamplingParams(temperature=temperature)
    repeating = [3, 9, 4, 3, 9, 4, 3, 9]
    decoders = [self_draft_decoder(tiny_llama, 3), Decoder(CausalLM(tiny_llama), PromptLookupDrafter(), 4, 5),
                Decoder(CausalLM(tiny_llama), ModelDrafter(CausalLM(tiny_model("llama", 5, layers=1)), 96,
                                                           TreeShape((3, 2, 1))), 3, 10)]
    for seed in range(4):
        for decoder in decoders:
            cfg = GenerationConfig(max_new_tokens=25, sampling=params, seed=seed, eos_token_ids=(9, 11, 40))
            got = decoder.generate(repeating, cfg)
            assert len(got.tokens) <= 25
            assert all(t not in (9, 11, 40) for t in got.tokens[:-1])  # nothing after the first EOS
            check_stats_match_tokens(got.tokens, got.stats)


def test_generator_is_created_on_the_target_device(tiny_llama, monkeypatch):
    """Sampling draws (multinomial, rand) on a CUDA target need a CUDA generator: the decoder asks
    for its generator on ``target.device``. Checked on the CPU by recording the request."""
    requested = []
    real = torch.Generator

    def spy(*args, **kwargs):  # records the device asked for: None when left to the CPU default
        device = args[0] if args else kwargs.get("device")
        requested.append(None if device is None else torch.device(device))
        return real(*args, **kwargs)

    monkeypatch.setattr(decoding.torch, "Generator", spy)
    lm = CausalLM(tiny_llama)
    Decoder(lm).generate(PROMPT, GenerationConfig(max_new_tokens=3, sampling=SamplingParams(temperature=1.0)))
    assert requested == [lm.device]


def test_decode_generator_seeds_like_a_plain_cpu_generator():
    a = decode_generator(torch.device("cpu"), 7)
    b = torch.Generator().manual_seed(7)
    assert a.device.type == "cpu"
    assert torch.equal(torch.rand(5, generator=a), torch.rand(5, generator=b))


def test_sampled_decoding_is_reproducible_per_seed(tiny_llama):
    decoder = self_draft_decoder(tiny_llama, 3)
    cfg = GenerationConfig(max_new_tokens=20, sampling=SamplingParams(temperature=1.0), seed=3)
    assert decoder.generate(PROMPT, cfg).tokens == decoder.generate(PROMPT, cfg).tokens
    other = GenerationConfig(max_new_tokens=20, sampling=SamplingParams(temperature=1.0), seed=4)
    assert decoder.generate(PROMPT, cfg).tokens != decoder.generate(PROMPT, other).tokens


@pytest.mark.parametrize("speculative", [False, True])
def test_after_round_streams_every_token_and_can_stop(tiny_llama, speculative):
    """``after_round`` sees the tokens grow round by round (what a server streams), and returning
    True ends decoding there with stats that describe what was returned."""
    decoder = self_draft_decoder(tiny_llama, 3) if speculative else Decoder(CausalLM(tiny_llama))
    cfg = GenerationConfig(max_new_tokens=30)
    full = decoder.generate(PROMPT, cfg).tokens
    seen: list[list[int]] = []

    def after_round(tokens: list[int]) -> bool:
        seen.append(list(tokens))
        return len(tokens) >= 10

    got = decoder.generate(PROMPT, cfg, after_round=after_round)
    assert got.tokens == full[: len(got.tokens)] and 10 <= len(got.tokens) < 30
    assert seen[-1] == got.tokens and all(a == b[: len(a)] for a, b in zip(seen, seen[1:]))
    assert len(seen) == got.stats.target_forwards  # once after the prefill, once per round
    check_stats_match_tokens(got.tokens, got.stats)
