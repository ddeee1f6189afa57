"""The drafter contract: a ``Draft`` (tokens as a tree, with the distributions they were drawn from)
and the ``Drafter`` protocol every drafter implements (HF candidate-generator style:
``begin`` / ``propose`` / ``observe``, plus ``reconfigure`` to switch strategies while decoding)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from runtime.kv_cache import KVCache
from runtime.sampling import SamplingParams
from search_spaces.strategy import Strategy


@dataclass
class Draft:
    """Draft tokens as a tree: node i has parent ``parents[i]`` (-1 = the last committed token).
    ``parents=None`` means a chain. ``q[i]`` is the distribution node i was drawn from; ``q=None``
    means deterministic proposals (verified as one-hot)."""

    tokens: torch.Tensor  # [N] long
    q: torch.Tensor | None  # [N, V]
    parents: tuple[int, ...] | None = None

    @property
    def is_chain(self) -> bool:
        return self.parents is None or all(p == i - 1 for i, p in enumerate(self.parents))


class Drafter(Protocol):
    """``begin`` once per prompt, then per round ``propose`` and ``observe`` the outcome:
    ``path`` lists the accepted node indices (for chains, ``range(n_accepted)``) and
    ``new_tokens`` are the tokens appended to the sequence (accepted drafts + the next token)."""

    def begin(self, prompt: list[int], capacity: int, target_cache: KVCache | None = None) -> None: ...

    def propose(self, k: int, params: SamplingParams, generator: torch.Generator) -> Draft: ...

    def observe(self, n_accepted: int, new_tokens: list[int], path: list[int] | None = None) -> None: ...

    def reconfigure(self, strategy: Strategy) -> None:
        """Draft as ``strategy`` says from the next round on, keeping what was learned of the
        sequence (caches, n-gram index): how a decoder switches strategies while decoding."""
        ...
