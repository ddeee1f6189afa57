"""Draft token trees as data (SpecInfer): ``tokens[N]``, ``parents[N]`` (-1 = the root, i.e. the
last committed token), optional proposal distributions. A tree is compiled once per shape into its
attention mask, depths and root-to-leaf paths. A chain is a tree of width 1.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch


@dataclass(frozen=True)
class CompiledTree:
    """Shape-only facts about a tree with ``N`` nodes; row 0 of a verify pass is the root."""

    parents: tuple[int, ...]
    depth: torch.Tensor  # [N] long, children of the root have depth 1
    mask: torch.Tensor  # [N+1, N+1] bool: row r sees column c iff c is r or an ancestor of r
    children: tuple[tuple[int, ...], ...]  # children[0] = root's, children[i+1] = node i's
    is_chain: bool
    depths: tuple[int, ...] = ()  # ``depth`` as host ints (statistics read it without a device read)

    @property
    def size(self) -> int:
        return len(self.parents)

    @property
    def max_depth(self) -> int:
        return max(self.depths, default=0)

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node``."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]


def check_parents(parents: tuple[int, ...]) -> None:
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"tree parents[{i}]={p}: a parent must be -1 (root) or an earlier node")


@lru_cache(maxsize=256)
def compile_tree(parents: tuple[int, ...]) -> CompiledTree:
    check_parents(parents)
    n = len(parents)
    depth = [0] * n
    mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    mask[:, 0] = True
    mask[0, 0] = True
    kids: list[list[int]] = [[] for _ in range(n + 1)]
    for i, p in enumerate(parents):
        depth[i] = 1 if p < 0 else depth[p] + 1
        mask[i + 1] = mask[p + 1]
        mask[i + 1, i + 1] = True
        kids[p + 1].append(i)
    chain = all(p == i - 1 for i, p in enumerate(parents))
    return CompiledTree(
        parents=parents,
        depth=torch.tensor(depth, dtype=torch.long),
        mask=mask,
        children=tuple(tuple(k) for k in kids),
        is_chain=chain,
        depths=tuple(depth),
    )


@dataclass(frozen=True)
class TreeTables:
    """A tree's shape facts as device tensors, built once per (shape, device, padding): what the
    verify pass and device-side acceptance index with (no host read per round)."""

    block: torch.Tensor  # [N+1+pad, N+1+pad] bool verify mask over the round's own rows
    offsets: torch.Tensor  # [N+1+pad] long position offsets of the rows (root and padding at 0)
    ancestors: torch.Tensor  # [N, N] bool: column j is node i or one of its ancestors
    depth: torch.Tensor  # [N] long
    parent_row: torch.Tensor  # [N] long: the verify row node i's token is checked against
    children: torch.Tensor  # [N+1, Wmax] long: row r's children, -1 padded
    max_depth: int


@lru_cache(maxsize=256)
def _tables(parents: tuple[int, ...], device: str, pad: int) -> TreeTables:
    tree = compile_tree(parents)
    n = tree.size
    wmax = max((len(c) for c in tree.children), default=0)
    kids = torch.full((n + 1, max(wmax, 1)), -1, dtype=torch.long)
    for r, c in enumerate(tree.children):
        kids[r, : len(c)] = torch.tensor(c, dtype=torch.long)
    zero = torch.zeros(1, dtype=torch.long)
    dev = torch.device(device)
    return TreeTables(
        block=verify_mask(tree, 0, pad).to(dev),
        offsets=torch.cat([zero, tree.depth, zero.expand(pad)]).to(dev),
        ancestors=tree.mask[1:, 1:].to(dev),
        depth=tree.depth.to(dev),
        parent_row=(torch.tensor(parents, dtype=torch.long) + 1).to(dev),
        children=kids[:, :wmax].to(dev),
        max_depth=tree.max_depth,
    )


def tree_tables(tree: CompiledTree, device: torch.device | str, pad: int = 0) -> TreeTables:
    return _tables(tree.parents, str(device), pad)


def verify_mask(tree: CompiledTree, prefix: int, pad: int = 0) -> torch.Tensor:
    """``[N+1+pad, prefix+N+1+pad]`` bool mask for a verify pass of root + nodes (+ padding rows,
    which see only the prefix and themselves, and are discarded)."""
    n = tree.size + 1
    rows = n + pad
    mask = torch.zeros(rows, prefix + rows, dtype=torch.bool)
    mask[:, :prefix] = True
    mask[:n, prefix : prefix + n] = tree.mask
    idx = torch.arange(n, rows)
    mask[idx, prefix + idx] = True
    return mask
