"""Drafters propose tokens; the target verifies them (HF candidate-generator style protocol)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from runtime.sampling import SamplingParams, logits_to_probs, sample
from runtime.transformer import CausalLM


@dataclass
class Draft:
    tokens: torch.Tensor  # [k] long
    q: torch.Tensor | None  # [k, V] draft distributions each token was drawn from; None = deterministic


class Drafter(Protocol):
    """``begin`` once per prompt, then per round ``propose`` k tokens and ``observe`` the outcome."""

    def begin(self, prompt: list[int], capacity: int) -> None: ...

    def propose(self, k: int, params: SamplingParams, generator: torch.Generator) -> Draft: ...

    def observe(self, n_accepted: int, new_tokens: list[int]) -> None: ...


class ModelDrafter:
    """Chain drafts from a smaller model of the same family, with its own KV cache.

    The cache holds a prefix of the committed sequence; ``pending`` are committed tokens not yet
    run through the draft (normally the target's last token, plus the last draft token when all
    drafts were accepted).
    """

    def __init__(self, model: CausalLM, target_vocab: int, confidence_threshold: float = 0.0) -> None:
        self.model = model
        self.target_vocab = target_vocab
        # SWIFT-style early stop: end the chain once the draft's top-1 probability falls below this
        self.confidence_threshold = confidence_threshold
        self.cache = model.new_cache(1)
        self.pending: list[int] = []
        self.base = 0
        self.k = 0  # tokens drafted this round
        self.fed = 0  # of those, how many are in the draft cache

    def begin(self, prompt: list[int], capacity: int) -> None:
        self.cache = self.model.new_cache(capacity)
        self.pending = list(prompt)

    def _step(self, tokens: list[int]) -> torch.Tensor:
        ids = torch.tensor(tokens, dtype=torch.long, device=self.model.device)
        return self.model(ids, self.cache, logits_for=slice(-1, None))[0].float()  # [V_draft]

    def propose(self, k: int, params: SamplingParams, generator: torch.Generator) -> Draft:
        self.k = self.fed = 0
        if k == 0:
            return Draft(torch.empty(0, dtype=torch.long), None)
        logits = self._step(self.pending)
        self.base = self.cache.length
        self.pending = []
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        for i in range(k):
            if i > 0 and self._unsure(logits):
                break
            if params.greedy:
                tok = int(logits.argmax())
            else:
                q = logits_to_probs(logits, params)
                tok = int(sample(q, generator))
                qs.append(q)
            tokens.append(tok)
            if i + 1 < k:
                logits = self._step([tok])
                self.fed += 1
        self.k = len(tokens)
        q_all = None if params.greedy else _pad_vocab(torch.stack(qs), self.target_vocab)
        return Draft(torch.tensor(tokens, dtype=torch.long), q_all)

    def _unsure(self, logits: torch.Tensor) -> bool:
        if self.confidence_threshold <= 0.0:
            return False
        return float(torch.softmax(logits, dim=-1).max()) < self.confidence_threshold

    def observe(self, n_accepted: int, new_tokens: list[int]) -> None:
        if self.k == 0:
            self.pending.extend(new_tokens)
            return
        kept = min(n_accepted, self.fed)  # accepted drafts whose K/V the draft cache already holds
        self.cache.rollback(self.base + kept)
        self.pending = list(new_tokens[kept:])


def _pad_vocab(q: torch.Tensor, vocab: int) -> torch.Tensor:
    """A restricted draft head gives q over ids [0, n); tokens beyond have q = 0."""
    return q if q.shape[-1] == vocab else F.pad(q, (0, vocab - q.shape[-1]))
