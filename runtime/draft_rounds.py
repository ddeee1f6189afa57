"""What a drafting model's round is made of: the host that owns the draft model's cache
(``DraftHost``, implemented by ``runtime.drafters.ModelDrafter``), the book of the round's rows
(``DraftRound``), the round drafters that propose on it (``RoundDrafter``: chains in
``runtime.chain_drafting``, trees in ``runtime.tree_drafting``, lookup-first in
``runtime.lookup_first``), and the static proposal both chains and fixed-width trees share."""
from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from runtime.draft import Draft, DraftSteps, Forward
from runtime.draft_shapes import StaticLayout, TreeShape, pad_vocab, static_layout
from runtime.kv_cache import KVCache
from runtime.sampling import SamplingParams, logits_to_probs
from runtime.transformer import CausalLM
from search_spaces.layer_plan import LayerPlan


@dataclass
class DraftRound:
    """Book-keeping of one drafted tree in the draft's cache."""

    base: int = 0  # draft cache length before the tree's rows
    slot: dict[int, int] = field(default_factory=dict)  # node -> row offset in the draft cache


class DraftHost(Protocol):
    """A draft model's state for one sequence: ``model`` drafts into ``cache`` under ``plan``,
    booking this round's rows in ``round``; ``q`` is padded to ``target_vocab``."""

    model: CausalLM
    cache: KVCache
    plan: LayerPlan | None
    round: DraftRound
    target_vocab: int

    def catch_up(self, depth: int, copy: Sequence[int] = ()) -> Generator[Forward, torch.Tensor, torch.Tensor]:
        """Run the committed tokens the draft has not seen (then ``copy``) -> logits from the last
        committed one on (``[1 + len(copy), Vd]``); ``depth``: the round drafts this deep at most."""
        ...


class RoundDrafter(Protocol):
    """Proposes one round on ``host`` in ``shape`` (already narrowed for the round), ``k`` deep at most."""

    def propose(
        self, host: DraftHost, shape: TreeShape, k: int, params: SamplingParams, gen: torch.Generator
    ) -> DraftSteps: ...


def propose_static(
    host: DraftHost, widths: tuple[int, ...], logits: torch.Tensor, params: SamplingParams, gen: torch.Generator
) -> DraftSteps:
    """A chain or a fixed-width tree: every depth is one forward over the whole frontier, its
    tokens picked on the device (top-k or sampled); nothing is read back. Node ``i`` of the
    tree's breadth-first order sits at draft-cache row ``base + i``."""
    layout = static_layout(widths, host.model.device)
    tokens: list[torch.Tensor] = []
    qs: list[torch.Tensor] = []
    for depth, w in enumerate(widths):
        if params.greedy:
            picked = torch.topk(logits, w, dim=-1).indices.reshape(-1)  # [F * w], row-major
        else:
            q = logits_to_probs(logits, params)  # [F, Vd]
            picked = torch.multinomial(q, w, replacement=True, generator=gen).reshape(-1)
            qs.append(q.repeat_interleave(w, dim=0))
        tokens.append(picked)
        if depth + 1 == len(widths):
            break
        logits = yield from _draft_depth(host, picked, depth, layout)
    q = None if params.greedy else pad_vocab(torch.cat(qs), host.target_vocab)
    return Draft(torch.cat(tokens), q, layout.parents)


def _draft_depth(
    host: DraftHost, frontier: torch.Tensor, depth: int, layout: StaticLayout
) -> Generator[Forward, torch.Tensor, torch.Tensor]:
    """One draft step of a static shape: the frontier's tokens ``[F]`` (device) at tree depth
    ``depth + 1`` through the draft under its plan -> their logits ``[F, Vd]``. A chain's step
    is the causal default; a tree's frontier sees the prefix, its ancestors and itself."""
    rnd = host.round
    offset = host.cache.length - rnd.base  # the frontier's first node index = its row offset
    pos = None if layout.chain else torch.full_like(frontier, rnd.base + depth)
    rel = None if layout.chain else layout.frontier_masks[depth]
    logits = (yield Forward(host.model, frontier, host.cache, positions=pos, rel_mask=rel, plan=host.plan)).float()
    for r in range(frontier.shape[0]):
        rnd.slot[offset + r] = offset + r
    return logits
