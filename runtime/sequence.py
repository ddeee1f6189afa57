"""A sequence's start: its settings, its state, and its prefill in chunks (``Decoder.start_steps``
drives it; the rounds live in ``runtime.decoding``)."""
from __future__ import annotations

import time
from collections.abc import Generator, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from runtime.draft import Drafter, KeepsRows
from runtime.errors import RuntimeUserError
from runtime.kv_cache import KVCache
from runtime.layout import BatchPart, Layout, PromptChunk
from runtime.prefix_cache import PrefixCache
from runtime.sampling import SamplingParams, logits_to_probs, sample
from runtime.stats import DecodeStats
from runtime.transformer import CausalLM


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0
    eos_token_ids: tuple[int, ...] = ()
    # a longer prompt is prefilled in forwards of this many tokens (llama.cpp's n_ubatch is 512):
    # a server runs its batch's steps between them, so a long prompt never stalls the running requests
    prefill_chunk: int = 512
    # rows of earlier sequences that start with the same tokens may be reused, and this one's kept for
    # later ones, where the decoder has a prefix cache (``Decoder.prefix``; llama-server's cache_prompt)
    cache_prompt: bool = True

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "prefill_chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RuntimeUserError(f"{name}={value!r} must be a positive integer")


def check_fits(prompt_len: int, max_new_tokens: int, limit: int, budget: str = "--max-new-tokens") -> None:
    """A prompt of ``prompt_len`` tokens plus ``max_new_tokens`` must fit the model context of
    ``limit`` positions; ``budget`` names the setting to lower (a CLI flag, an API field)."""
    if prompt_len == 0:
        raise RuntimeUserError("the prompt is empty; give at least one token of input")
    if prompt_len + max_new_tokens > limit:
        raise RuntimeUserError(
            f"prompt ({prompt_len} tokens) + {budget.lstrip('-')} ({max_new_tokens}) exceeds the "
            f"model context of {limit} tokens; shorten the prompt or lower {budget}"
        )


@dataclass
class GenerationResult:
    tokens: list[int]  # new tokens only (EOS included if produced)
    stats: DecodeStats


@dataclass
class Sequence:
    """One prompt's decoding state (``Decoder.start``): its tokens so far, KV cache, random
    source and stats. Its decoder's drafters follow it: a decoder serves one sequence at a time."""

    prompt: list[int]
    config: GenerationConfig
    capacity: int
    out: list[int] = field(default_factory=list)  # new tokens so far
    cache: KVCache = None  # type: ignore[assignment]  # set by Decoder.start
    gen: torch.Generator = None  # type: ignore[assignment]
    stats: DecodeStats = field(default_factory=DecodeStats)
    started: float = field(default_factory=time.perf_counter)

    @property
    def eos(self) -> frozenset[int]:
        return frozenset(self.config.eos_token_ids)

    @property
    def finished(self) -> bool:
        """The token budget is spent or the last token is an EOS."""
        return len(self.out) >= self.config.max_new_tokens or self.out[-1] in self.config.eos_token_ids

    def result(self) -> GenerationResult:
        assert len(self.out) <= self.config.max_new_tokens  # a round's draft length is capped by the budget
        self.stats.wall_s = time.perf_counter() - self.started
        self.stats.new_tokens = len(self.out)
        return GenerationResult(self.out, self.stats)


def prefill_steps(
    target: CausalLM, drafters: Iterable[Drafter], prefix: PrefixCache | None, prompt: list[int],
    config: GenerationConfig, capacity: int, holder: Any,
) -> Generator[PromptChunk, tuple[torch.Tensor, float] | None, Sequence]:
    """Start a sequence of ``capacity`` rows on ``target``'s cache (its slot for ``holder`` where it
    has slots): ``Decoder.start_steps``' contract. ``drafters`` (the drafting one first) begin on
    the prompt and its first token; ``prefix`` (None: no prefix cache) gives the prompt's leading
    rows and keeps its rows once prefilled."""
    seq = Sequence(prompt, config, capacity=capacity)
    seq.gen = decode_generator(target.device, config.seed)
    seq.cache = sequence_cache(target, holder, capacity)
    chunk, spent = config.prefill_chunk, 0.0
    if prefix is not None:  # the last prompt token always runs: its logits give the first new token
        started = time.perf_counter()
        seq.stats.prefix_rows = prefix.reuse(target, prompt, seq.cache, chunk, len(prompt) - 1)
        spent += time.perf_counter() - started
    for at in range(seq.stats.prefix_rows, len(prompt), chunk):
        ids = torch.tensor(prompt[at : at + chunk], device=target.device)
        ran = yield PromptChunk(BatchPart(ids, seq.cache, logits_for=slice(-1, None)), at + len(ids), len(prompt))
        started = time.perf_counter()
        with torch.inference_mode():  # never held across a yield: the caller's code runs there
            if ran is None:
                logits = target(ids, seq.cache, Layout.chunk(), logits_for=slice(-1, None))
            else:
                logits, shared = ran
                spent += shared
            if at + chunk >= len(prompt):
                seq.out.append(pick(logits[0], config.sampling, seq.gen))
                if prefix is not None:  # shared by later prompts (and batch-mates) from now on
                    prefix.offer(target, prompt, seq.cache, len(prompt), chunk)
                for drafter in drafters:
                    drafter.begin(prompt + seq.out, seq.capacity, seq.cache)
                    if prefix is not None and isinstance(drafter, KeepsRows):
                        drafter.reuse_rows(prefix, chunk)
        spent += time.perf_counter() - started
    seq.stats.prefill_s = spent  # the prefill's own forwards (a server's steps between chunks are not its cost)
    seq.stats.target_forwards = 1  # the prefill counts as one, however many chunks it took
    return seq


def sequence_cache(target: CausalLM, holder: Any, capacity: int) -> KVCache:
    """A sequence's target cache: ``holder``'s slot of the target's ``SlotCache`` where it has one
    and the sequence fits (``runtime.slots``: batched steps then run as one static-shape forward),
    else its own."""
    slots = target.slots
    cache = slots.take(holder, capacity) if slots is not None else None
    return cache if cache is not None else target.new_cache(capacity, reuse=True)


def keep_rows(target: CausalLM, drafters: Iterable[Drafter], prefix: PrefixCache, seq: Sequence) -> None:
    """Offer ``seq``'s committed rows, and its drafting models' (``drafters``), to ``prefix``."""
    tokens = seq.prompt + seq.out
    prefix.offer(target, tokens, seq.cache, seq.cache.length, seq.config.prefill_chunk)
    for drafter in drafters:
        if isinstance(drafter, KeepsRows):
            drafter.offer_rows(prefix, seq.config.prefill_chunk)


def pick(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
    if params.greedy:
        return int(logits.argmax())
    return int(sample(logits_to_probs(logits.float(), params), gen))


def decode_generator(device: torch.device | str, seed: int) -> torch.Generator:
    """The decode loop's random source, on the device its draws run on (CUDA sampling with a CPU
    generator fails). On the CPU, the same seed gives the same stream as ``torch.Generator()``."""
    return torch.Generator(device=device).manual_seed(seed)
