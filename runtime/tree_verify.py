"""Verifying a draft tree against the target (SpecInfer).

Greedy: follow the child whose token equals the target's argmax, as deep as possible; the next
token is the argmax at the last accepted node.

Sampling: multi-step speculative sampling (SpecInfer Theorem 4.2). At the current node with target
distribution p, try its children in order; child s (token x, proposal q_s) is accepted with
probability min(1, p[x] / q_s[x]); on rejection p becomes norm(max(0, p - q_s)). When every child
fails, the next token is drawn from the (residual) p. Each step is an ordinary lossless
speculative-sampling step against the current p, so the result is distributed exactly as the
target, for any tree, duplicate children and one-hot (deterministic) proposals included.
"""
from __future__ import annotations

import torch

from runtime.sampling import residual
from runtime.tree import CompiledTree, tree_tables


# Device-side acceptance returns one long tensor that the decode loop reads back once:
#   ``(n, path_1 .. path_D, t_0 .. t_D)``, D = the tree's depth: ``n`` accepted nodes, their
#   indices by depth (-1 past n) and the tokens the round appends (``t_0 .. t_n``; padding after).


def accept_tree_greedy(target_argmax: torch.Tensor, tree: CompiledTree, tokens: torch.Tensor) -> torch.Tensor:
    """Greedy tree verification on the device. A node is valid when it and every ancestor carry
    the target's argmax at their parent's row; the deepest valid node (the lowest index among
    equally deep ones) ends the accepted path."""
    dev = target_argmax.device
    if tree.size == 0:
        return torch.cat([torch.zeros(1, dtype=torch.long, device=dev), target_argmax[:1]])
    t = tree_tables(tree, dev)
    n_nodes, depth_max = tree.size, t.max_depth
    tokens = tokens.to(dev)
    match = tokens == target_argmax[t.parent_row]  # [N]
    valid = ~(t.ancestors & ~match[None, :]).any(dim=1)  # [N]
    index = torch.arange(n_nodes, device=dev)
    score = torch.where(valid, t.depth * (n_nodes + 1) + (n_nodes - index), 0)
    best = score.argmax()
    found = score[best] > 0
    n = torch.where(found, t.depth[best], 0)
    levels = torch.arange(1, depth_max + 1, device=dev)
    on_path = t.ancestors[best][None, :] & (t.depth[None, :] == levels[:, None]) & found  # [D, N]
    path = torch.where(on_path.any(dim=1), (on_path.long() * index).sum(dim=1), -1)  # [D]
    nxt = target_argmax[torch.where(found, best + 1, 0)]
    return torch.cat([n[None], path, _appended(tokens, path, n, nxt)])


def accept_tree(
    p: torch.Tensor,  # [N+1, V] adjusted target distributions, row 0 = root
    tree: CompiledTree,
    tokens: torch.Tensor,  # [N]
    q: torch.Tensor | None,  # [N, V]: the distribution node i was drawn from; None = deterministic
    generator: torch.Generator,
) -> torch.Tensor:
    """SpecInfer multi-step speculative sampling on the device, with static loops: at each depth
    the current node's children (its row of the children table) are tried in order, each
    accepted with probability ``min(1, p[x] / q_s[x])``, ``p`` becoming ``residual(p, q_s)`` after
    a rejection; a slot past the last child, or after an acceptance, changes nothing. Each try
    draws its own uniform, so the draws are independent as in :func:`verify_tree`."""
    dev = p.device
    t = tree_tables(tree, dev)
    tokens = tokens.to(dev)
    vocab = p.shape[1]
    row = torch.zeros((), dtype=torch.long, device=dev)
    alive = torch.ones((), dtype=torch.bool, device=dev)
    dist = p[0]
    path = []
    for _ in range(t.max_depth):
        kids = t.children[row]  # [Wmax]
        chosen = torch.full((), -1, dtype=torch.long, device=dev)
        for j in range(t.children.shape[1]):
            child = kids[j]
            tried = alive & (child >= 0) & (chosen < 0)
            node = child.clamp(min=0)
            x = tokens[node]
            q_s = q[node] if q is not None else torch.nn.functional.one_hot(x, vocab).to(p.dtype)
            u = torch.rand((), generator=generator, dtype=torch.float64, device=dev)
            ok = tried & (u * q_s[x] < dist[x])
            dist = torch.where(tried & ~ok, residual(dist, q_s), dist)
            chosen = torch.where(ok, child, chosen)
        alive = alive & (chosen >= 0)
        path.append(torch.where(alive, chosen, -1))
        row = torch.where(alive, chosen + 1, row)
        dist = torch.where(alive, p[row], dist)
    nxt = torch.multinomial(dist, 1, generator=generator)[0]
    path_t = torch.stack(path) if path else torch.empty(0, dtype=torch.long, device=dev)
    n = (path_t >= 0).sum()
    return torch.cat([n[None], path_t, _appended(tokens, path_t, n, nxt)])


def _appended(tokens: torch.Tensor, path: torch.Tensor, n: torch.Tensor, nxt: torch.Tensor) -> torch.Tensor:
    """``[D + 1]``: the accepted path's tokens, then ``nxt`` at position ``n`` (and after)."""
    on_path = tokens[path.clamp(min=0)] if tokens.numel() else path
    kept = torch.cat([on_path, nxt.reshape(1)])
    return torch.where(torch.arange(kept.shape[0], device=kept.device) < n, kept, nxt)


def read_tree_result(out: list[int], depth: int) -> tuple[list[int], list[int]]:
    """The host view of an ``accept_tree*`` result -> (accepted node indices, appended tokens)."""
    n = out[0]
    return out[1 : 1 + n], out[1 + depth : 2 + depth + n]


def verify_tree_greedy(
    target_argmax: torch.Tensor, tree: CompiledTree, tokens: torch.Tensor
) -> tuple[list[int], int]:
    """target_argmax ``[N+1]`` (row 0 = root). Returns (accepted node indices, next token).
    Among duplicate siblings that both match, the one leading to the longer path wins."""
    path, new = read_tree_result(accept_tree_greedy(target_argmax, tree, tokens).tolist(), tree.max_depth)
    return path, new[-1]


def verify_tree(
    p: torch.Tensor,  # [N+1, V] adjusted target distributions, row 0 = root
    tree: CompiledTree,
    tokens: torch.Tensor,  # [N]
    q: torch.Tensor | None,  # [N, V]: the distribution node i was drawn from; None = deterministic
    generator: torch.Generator,
) -> tuple[list[int], int]:
    """Multi-step speculative sampling over the tree -> (accepted node indices, next token).
    Checked inputs; the decode loop runs :func:`accept_tree` itself (no host reads)."""
    _check_inputs(p, tree, tokens, q)
    path, new = read_tree_result(accept_tree(p, tree, tokens, q, generator).tolist(), tree.max_depth)
    return path, new[-1]


def _check_inputs(p: torch.Tensor, tree: CompiledTree, tokens: torch.Tensor, q: torch.Tensor | None) -> None:
    n = tree.size
    if tokens.shape != (n,) or p.dim() != 2 or p.shape[0] != n + 1:
        raise ValueError(
            f"tree of {n} nodes needs tokens [{n}] and p [{n + 1}, V]; got {tuple(tokens.shape)} and {tuple(p.shape)}"
        )
    if q is None:
        return
    if q.shape != (n, p.shape[1]):
        raise ValueError(f"q must have shape [{n}, {p.shape[1]}], got {tuple(q.shape)}")
    zero = (q.gather(1, tokens.long()[:, None])[:, 0] <= 0).nonzero()
    if zero.numel():
        node = int(zero[0])
        raise ValueError(f"tree node {node} has token {int(tokens[node])} with proposal probability 0")
