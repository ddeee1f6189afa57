"""The drafter contract: a ``Draft`` (tokens as a tree, with the distributions they were drawn from)
and the ``Drafter`` protocol every drafter implements (HF candidate-generator style:
``begin`` / ``propose`` / ``observe``, plus ``reconfigure`` to switch strategies while decoding)."""
from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from runtime.kv_cache import KVCache
from runtime.layout import Layout
from runtime.sampling import SamplingParams
from search_spaces.strategy import Strategy

if TYPE_CHECKING:
    from runtime.prefix_cache import PrefixCache
    from runtime.transformer import CausalLM
    from search_spaces.layer_plan import LayerPlan


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


@dataclass(frozen=True)
class Forward:
    """One forward a drafter needs (``ModelDrafter.propose_steps`` yields them): ``model`` over
    ``tokens`` into ``cache``, as ``CausalLM.forward`` takes them. Alone it runs as it is; in a
    batch, forwards of drafters sharing one draft model's weights run as one
    (``runtime.batching``)."""

    model: "CausalLM"
    tokens: torch.Tensor  # [T] long
    cache: KVCache
    positions: torch.Tensor | None = None
    rel_mask: torch.Tensor | None = None
    logits_for: slice | None = None
    plan: "LayerPlan | None" = None

    def run(self) -> torch.Tensor:
        layout = Layout(positions=self.positions, rel_mask=self.rel_mask)
        return self.model(self.tokens, self.cache, layout, logits_for=self.logits_for, plan=self.plan)


# a drafter's propose as steps: yields each Forward, is sent its logits, returns the Draft
DraftSteps = Generator[Forward, torch.Tensor, Draft]


# Optional capabilities: a drafter declares one by subclassing its protocol; ``Decoder`` asks
# ``isinstance`` and never probes attributes.
@runtime_checkable
class Stepped(Protocol):
    """``propose`` as steps (``DraftSteps``): a batch runs the forwards of several drafters as one."""

    def propose_steps(self, k: int, params: SamplingParams, generator: torch.Generator) -> DraftSteps: ...


@runtime_checkable
class CatchesUp(Protocol):
    """Keeps a cache of its own: ``pending`` committed tokens it has not run yet, which ``sync``
    runs (all but the last, whose logits start the next draft)."""

    pending: list[int]

    def sync(self) -> None: ...


@runtime_checkable
class KeepsRows(Protocol):
    """Its own model's K/V rows can come from a prefix cache and go back to it
    (``runtime.prefix_cache``), where that model's rows are reusable."""

    def reuse_rows(self, prefix: "PrefixCache", chunk: int) -> int: ...

    def offer_rows(self, prefix: "PrefixCache", chunk: int) -> None: ...

    def forget_rows(self) -> None:
        """Its next sequence keeps none of the rows it holds now (a server's cache reset)."""
        ...


@runtime_checkable
class Narrows(Protocol):
    """Drafts trees that a batch under load may narrow: ``width_cap`` children per node at most
    next round (None: its shape's)."""

    width_cap: int | None


def drive(steps: Generator[Forward, torch.Tensor, Draft]) -> Draft:
    """Run ``steps`` alone: each forward as it comes."""
    try:
        forward = next(steps)
        while True:
            forward = steps.send(forward.run())
    except StopIteration as done:
        return done.value
