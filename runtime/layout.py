"""How a forward's new rows attend: one value for chains, prompt chunks, blocks (trees, verify
passes) and explicit masks, built by its constructors and read by ``runtime.step_runner``."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.attention import InvariantRows, round_keys
from runtime.kv_cache import KVCache


@dataclass(frozen=True, eq=False)
class Layout:
    """The attention layout of one forward's ``T`` new rows.

    ``chain()`` (the default): causal after the cache, RoPE at the rows' slots (a prompt into an
    empty cache runs as a prefill). ``chunk()``: a prompt's later chunk, run as a prefill over the
    cache's first ``length + T`` slots. ``block(rel_mask, positions)``: ``rel_mask`` ``[T, R]`` over
    the last ``R`` slots (a draft tree's or a verify pass's rows, the prefix before them visible),
    RoPE at ``positions``. ``explicit(mask, positions)``: ``mask`` ``[T, length + T]``, any pattern."""

    positions: torch.Tensor | None = None  # [T] RoPE positions; None: the rows' slots
    rel_mask: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    chunk_of_prompt: bool = False

    def __post_init__(self) -> None:
        if self.rel_mask is not None and self.mask is not None:
            raise ValueError("a layout has a relative block mask or an explicit mask, not both")
        if self.chunk_of_prompt and (self.positions is not None or self.rel_mask is not None or self.mask is not None):
            raise ValueError("a prompt chunk attends causally at its slots: no positions or masks")

    @classmethod
    def chain(cls, positions: torch.Tensor | None = None) -> Layout:
        return CHAIN if positions is None else cls(positions=positions)

    @classmethod
    def chunk(cls) -> Layout:
        return PROMPT_CHUNK

    @classmethod
    def block(cls, rel_mask: torch.Tensor | None, positions: torch.Tensor | None = None) -> Layout:
        return cls(positions=positions, rel_mask=rel_mask)

    @classmethod
    def explicit(cls, mask: torch.Tensor, positions: torch.Tensor | None = None) -> Layout:
        return cls(positions=positions, mask=mask)

    def prefill(self, start: int, t: int) -> bool:
        """Whether ``t`` rows after ``start`` cached ones run as a prefill (exact length, causal)."""
        plain = self.positions is None and self.rel_mask is None and self.mask is None
        return plain and (self.chunk_of_prompt or (start == 0 and t > 1))


@dataclass(frozen=True)
class BatchPart:
    """One sequence's rows in a batched forward (``CausalLM.forward_batch``): its own cache, its
    own attention (causal, or a block ``rel_mask`` at ``positions``) and the rows that get logits."""

    tokens: torch.Tensor  # [T] long
    cache: KVCache
    positions: torch.Tensor | None = None  # [T] rope positions; default cache.length + arange
    rel_mask: torch.Tensor | None = None  # [T, R] bool over the last R slots (a tree), else causal
    logits_for: slice | None = None  # which of its rows get logits (None: all)


@dataclass(frozen=True, eq=False)
class PromptChunk:
    """A prompt chunk a prefill is about to run (``Decoder.start_steps``): its rows as a part of a
    batched forward (``part``: causal after the prompt's earlier rows, logits for its last row),
    and the prompt's tokens prefilled once it has run (``done`` of ``total``)."""

    part: BatchPart
    done: int
    total: int

    @property
    def rows(self) -> int:
        return int(self.part.tokens.shape[0])

    @property
    def last(self) -> bool:
        """Whether the prompt's first new token comes out of this chunk."""
        return self.done >= self.total


CHAIN = Layout()
PROMPT_CHUNK = Layout(chunk_of_prompt=True)


# how rows attend on a backend with row-by-row attention (``CausalLM.row_attention``): each row by its mask
ROW_KERNEL = InvariantRows(())


def invariant_rows(t: int, start: int, positions: torch.Tensor, rel_mask: torch.Tensor | None,
                   full: torch.Tensor | None, mask: torch.Tensor) -> InvariantRows:
    """How a forward's ``t`` rows attend on a quantised backend (``runtime.attention.sdpa_invariant``)."""
    if full is not None:  # an explicit mask: any row may see any slot of the forward
        return InvariantRows(((0, t, round_keys(start + t)),))
    if rel_mask is None:
        return InvariantRows.contiguous(start, t)
    return InvariantRows.gathered(mask, positions)
