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

from runtime.sampling import residual, sample
from runtime.tree import CompiledTree


def verify_tree_greedy(
    target_argmax: torch.Tensor, tree: CompiledTree, tokens: torch.Tensor
) -> tuple[list[int], int]:
    """target_argmax ``[N+1]`` (row 0 = root). Returns (accepted node indices, next token).
    Among duplicate siblings that both match, the one leading to the longer path wins."""
    best = target_argmax.tolist()
    toks = tokens.tolist()

    def longest(row: int) -> list[int]:
        paths = [[c] + longest(c + 1) for c in tree.children[row] if toks[c] == best[row]]
        return max(paths, key=len, default=[])

    path = longest(0)
    return path, best[path[-1] + 1 if path else 0]


def verify_tree(
    p: torch.Tensor,  # [N+1, V] adjusted target distributions, row 0 = root
    tree: CompiledTree,
    tokens: torch.Tensor,  # [N]
    q: torch.Tensor | None,  # [N, V]: the distribution node i was drawn from; None = deterministic
    generator: torch.Generator,
) -> tuple[list[int], int]:
    """Multi-step speculative sampling over the tree -> (accepted node indices, next token)."""
    _check_inputs(p, tree, tokens, q)
    toks = tokens.tolist()
    path: list[int] = []
    row = 0
    while True:
        dist = p[row]
        accepted = None
        for child in tree.children[row]:
            x = toks[child]
            q_s = _proposal(q, child, x, dist)
            if q_s[x] <= 0:
                raise ValueError(f"tree node {child} has token {x} with proposal probability 0")
            u = torch.rand((), generator=generator, dtype=torch.float64)
            if float(u) * float(q_s[x]) < float(dist[x]):
                accepted = child
                break
            dist = residual(dist, q_s)
        if accepted is None:
            return path, int(sample(dist, generator))
        path.append(accepted)
        row = accepted + 1


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


def _proposal(q: torch.Tensor | None, node: int, token: int, like: torch.Tensor) -> torch.Tensor:
    if q is not None:
        return q[node]
    onehot = torch.zeros_like(like)
    onehot[token] = 1.0
    return onehot
