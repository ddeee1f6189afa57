"""A drafting model's tree round (``TreeDrafter``), depth by depth: a fixed-width shape (every
depth one forward over the whole frontier, nothing read back) or a confidence-aware one (children
per node by its top-1 probability, one host read per depth)."""
from __future__ import annotations

from collections.abc import Generator

import torch

from runtime.draft import Draft, DraftSteps, Forward
from runtime.draft_rounds import DraftHost, propose_static
from runtime.draft_shapes import TreeShape, node_depth, pad_vocab
from runtime.sampling import SamplingParams, logits_to_probs


class TreeDrafter:
    """Proposes token trees (a shape with widths above 1, or SWIFT's dynamic widths)."""

    def propose(
        self, host: DraftHost, shape: TreeShape, k: int, params: SamplingParams, gen: torch.Generator
    ) -> DraftSteps:
        logits = yield from host.catch_up(len(shape.widths))  # [1, Vd]
        host.round.base = host.cache.length
        widths = shape.widths[: min(k, len(shape.widths))]
        if shape.dynamic is None and shape.threshold <= 0:
            return (yield from propose_static(host, widths, logits, params, gen))
        return (yield from self._propose_adaptive(host, shape, len(widths), logits, params, gen))

    def _propose_adaptive(
        self, host: DraftHost, shape: TreeShape, depth_max: int, logits: torch.Tensor, params: SamplingParams,
        generator: torch.Generator,
    ) -> DraftSteps:
        """Confidence-aware shapes (a threshold, SWIFT's dynamic widths): how many children a node
        gets depends on its top-1 probability, one host read per depth."""
        tokens: list[int] = []
        parents: list[int] = []
        qs: list[torch.Tensor] = []
        frontier = [-1]  # nodes whose children are drafted from `logits` rows
        for depth in range(depth_max):
            expand = _add_children(frontier, logits, depth, shape, params, generator, tokens, parents, qs)
            if not expand or depth + 1 == depth_max:
                break
            logits = yield from _forward_frontier(host, expand, tokens, parents)
            frontier = expand
        q = None if params.greedy else pad_vocab(torch.stack(qs), host.target_vocab)
        return Draft(torch.tensor(tokens, dtype=torch.long, device=host.model.device), q, tuple(parents))


def _add_children(
    frontier: list[int], logits: torch.Tensor, depth: int, shape: TreeShape,
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
    host: DraftHost, nodes: list[int], tokens: list[int], parents: list[int]
) -> Generator[Forward, torch.Tensor, torch.Tensor]:
    """Run frontier nodes through the draft in one forward; each sees the prefix + ancestors."""
    rnd = host.round
    start = host.cache.length
    depth_of = {n: node_depth(n, parents) for n in nodes}
    positions = torch.tensor([rnd.base - 1 + depth_of[n] for n in nodes], device=host.model.device)
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
        rel = rel.to(host.model.device)
    for r, n in enumerate(nodes):
        rnd.slot[n] = start - rnd.base + r
    ids = torch.tensor([tokens[n] for n in nodes], dtype=torch.long, device=host.model.device)
    positions = None if chain else positions  # a chain's rows sit at slot == position: the causal default
    logits = yield Forward(host.model, ids, host.cache, positions=positions, rel_mask=rel, plan=host.plan)
    return logits.float()  # [F, Vd]
