"""Drafting a round's token tree with a model, depth by depth (``TreeDrafting``): a static shape
(every depth one forward over the whole frontier, nothing read back) or a confidence-aware one
(children per node by its top-1 probability, one host read per depth). Chains are the static
shape of width 1. ``ModelDrafter`` mixes it in; the methods read its model, cache, plan and round."""
from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field

import torch

from runtime.draft import Draft, DraftSteps, Forward
from runtime.draft_shapes import StaticLayout, TreeShape, node_depth, pad_vocab, static_layout
from runtime.kv_cache import KVCache
from runtime.sampling import SamplingParams, logits_to_probs
from runtime.transformer import CausalLM
from search_spaces.layer_plan import LayerPlan


@dataclass
class DraftRound:
    """Book-keeping of one drafted tree in the draft's cache."""

    base: int = 0  # draft cache length before the tree's rows
    slot: dict[int, int] = field(default_factory=dict)  # node -> row offset in the draft cache


class TreeDrafting:
    """The tree (and chain) proposals of a drafter that drafts with ``model`` into ``cache``,
    under ``plan``, booking rows in ``round``; ``q`` is padded to ``target_vocab``."""

    model: CausalLM
    cache: KVCache
    plan: LayerPlan | None
    round: DraftRound
    target_vocab: int

    def _propose_static(
        self, widths: tuple[int, ...], logits: torch.Tensor, params: SamplingParams, gen: torch.Generator
    ) -> DraftSteps:
        """A chain or a fixed-width tree: every depth is one forward over the whole frontier, its
        tokens picked on the device (top-k or sampled); nothing is read back. Node ``i`` of the
        tree's breadth-first order sits at draft-cache row ``base + i``."""
        layout = static_layout(widths, self.model.device)
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
            logits = yield from self.draft_depth(picked, depth, layout)
        q = None if params.greedy else pad_vocab(torch.cat(qs), self.target_vocab)
        return Draft(torch.cat(tokens), q, layout.parents)

    def draft_depth(
        self, frontier: torch.Tensor, depth: int, layout: StaticLayout
    ) -> Generator[Forward, torch.Tensor, torch.Tensor]:
        """One draft step of a static shape: the frontier's tokens ``[F]`` (device) at tree depth
        ``depth + 1`` through the draft under its plan -> their logits ``[F, Vd]``. A chain's step
        is the causal default; a tree's frontier sees the prefix, its ancestors and itself."""
        rnd = self.round
        offset = self.cache.length - rnd.base  # the frontier's first node index = its row offset
        pos = None if layout.chain else torch.full_like(frontier, rnd.base + depth)
        rel = None if layout.chain else layout.frontier_masks[depth]
        logits = (yield Forward(self.model, frontier, self.cache, positions=pos, rel_mask=rel, plan=self.plan)).float()
        for r in range(frontier.shape[0]):
            rnd.slot[offset + r] = offset + r
        return logits

    def _propose_adaptive(
        self, shape: TreeShape, depth_max: int, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
    ) -> DraftSteps:
        """Confidence-aware shapes (a threshold, SWIFT's dynamic widths): how many children a node
        gets depends on its top-1 probability, one host read per depth."""
        tokens: list[int] = []
        parents: list[int] = []
        qs: list[torch.Tensor] = []
        frontier = [-1]  # nodes whose children are drafted from `logits` rows
        for depth in range(depth_max):
            expand = self._add_children(frontier, logits, depth, shape, params, generator, tokens, parents, qs)
            if not expand or depth + 1 == depth_max:
                break
            logits = yield from self._forward_frontier(expand, tokens, parents)
            frontier = expand
        q = None if params.greedy else pad_vocab(torch.stack(qs), self.target_vocab)
        return Draft(torch.tensor(tokens, dtype=torch.long, device=self.model.device), q, tuple(parents))

    def _add_children(
        self, frontier: list[int], logits: torch.Tensor, depth: int, shape: TreeShape,
        params: SamplingParams, gen: torch.Generator, tokens: list[int], parents: list[int], qs: list[torch.Tensor],
    ) -> list[int]:
        """Append the children of every frontier node; return the nodes to expand next."""
        expand: list[int] = []
        # top-1 probability per frontier row, only when the shape depends on it
        needs_conf = shape.dynamic is not None or (depth > 0 and shape.threshold > 0)
        conf = torch.softmax(logits, dim=-1).amax(dim=-1).tolist() if needs_conf else [1.0] * len(frontier)
        for row, node in enumerate(frontier):
            n_children, n_expand = shape.children(depth, conf[row])
            if n_children == 0:
                continue
            if params.greedy:
                picked = torch.topk(logits[row], n_children).indices.tolist()
            else:
                q = logits_to_probs(logits[row], params)
                picked = torch.multinomial(q, n_children, replacement=True, generator=gen).tolist()
                qs.extend([q] * n_children)
            for j, tok in enumerate(picked):
                if j < n_expand:
                    expand.append(len(tokens))
                tokens.append(tok)
                parents.append(node)
        return expand

    def _forward_frontier(
        self, nodes: list[int], tokens: list[int], parents: list[int]
    ) -> Generator[Forward, torch.Tensor, torch.Tensor]:
        """Run frontier nodes through the draft in one forward; each sees the prefix + ancestors."""
        rnd = self.round
        start = self.cache.length
        depth_of = {n: node_depth(n, parents) for n in nodes}
        positions = torch.tensor([rnd.base - 1 + depth_of[n] for n in nodes], device=self.model.device)
        chain = len(nodes) == 1 and len(rnd.slot) == depth_of[nodes[0]] - 1
        rel = None  # a chain: causal
        if not chain:  # the round's rows so far, then these: each sees its ancestors and itself
            rel = torch.zeros(len(nodes), start - rnd.base + len(nodes), dtype=torch.bool)
            for r, n in enumerate(nodes):
                rel[r, start - rnd.base + r] = True
                a = parents[n]
                while a >= 0:
                    rel[r, rnd.slot[a]] = True
                    a = parents[a]
            rel = rel.to(self.model.device)
        for r, n in enumerate(nodes):
            rnd.slot[n] = start - rnd.base + r
        ids = torch.tensor([tokens[n] for n in nodes], dtype=torch.long, device=self.model.device)
        positions = None if chain else positions  # a chain's rows sit at slot == position: the causal default
        logits = yield Forward(self.model, ids, self.cache, positions=positions, rel_mask=rel, plan=self.plan)
        return logits.float()  # [F, Vd]

