"""Drafters propose tokens; the target verifies them (HF candidate-generator style protocol)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from runtime.kv_cache import KVCache
from runtime.sampling import SamplingParams, logits_to_probs
from runtime.transformer import CausalLM
from search_spaces.layer_plan import LayerPlan
from search_spaces.strategy import tree_node_bound


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


@dataclass(frozen=True)
class TreeShape:
    """How many children each node gets.

    ``widths[d]``: children per node at depth ``d`` (all of them expanded further); its length is
    the maximum depth. ``dynamic``: SWIFT's dynamic verification table ``((p_max, k), ...)``; when
    set, a node whose draft top-1 probability is ``<= p_max`` gets the top-``k`` candidates, and only
    the top-1 child is drafted further (a chain with alternatives). ``threshold``: a node whose draft
    top-1 probability is below it gets no children (confidence-aware early stop; depth >= 1)."""

    widths: tuple[int, ...]
    dynamic: tuple[tuple[float, int], ...] | None = None
    threshold: float = 0.0

    def children(self, depth: int, confidence: float) -> tuple[int, int]:
        """-> (number of children, how many of them are expanded at the next depth)."""
        if depth > 0 and confidence < self.threshold:
            return 0, 0
        if self.dynamic is not None:
            k = next((k for p_max, k in self.dynamic if confidence <= p_max), self.dynamic[-1][1])
            return k, 1
        w = self.widths[depth]
        return w, w

    def max_nodes(self) -> int:
        return tree_node_bound(self.widths, self.dynamic)


@dataclass
class _Round:
    """Book-keeping of one drafted tree in the draft's cache."""

    base: int = 0  # draft cache length before the tree's rows
    slot: dict[int, int] = field(default_factory=dict)  # node -> row offset in the draft cache


class ModelDrafter:
    """Drafts a chain or a token tree with a smaller model of the same family (own KV cache).

    Each depth is one draft forward over all frontier nodes with a tree attention mask. The cache
    holds a prefix of the committed sequence plus this round's drafted rows; ``pending`` are
    committed tokens the draft has not seen yet.

    With a layer ``plan`` the drafted rows run under it (fuzzy groups, skipped sub-layers). With
    ``calibrate`` (EasySpec bonus calibration) every drafted row is discarded after verification
    and the committed tokens (accepted + bonus) are re-run exactly in one forward, whose last
    logits give the next round's first draft token; without it, the accepted rows' fuzzy K/V
    are kept and the remaining tokens run under the plan too.
    """

    def __init__(
        self, model: CausalLM, target_vocab: int, shape: TreeShape | None = None,
        plan: LayerPlan | None = None, calibrate: bool = True,
    ) -> None:
        self.model = model
        self.target_vocab = target_vocab
        self.shape = shape
        self.plan = None if plan is None or plan.is_identity else plan
        self.calibrate = calibrate and self.plan is not None
        self.cache = model.new_cache(1)
        self.pending: list[int] = []
        self.round = _Round()

    def reconfigure(self, shape: TreeShape | None, plan: LayerPlan | None, calibrate: bool) -> None:
        """Draft differently from the next round on, keeping the cache (online tuning)."""
        self.shape = shape
        self.plan = None if plan is None or plan.is_identity else plan
        self.calibrate = calibrate and self.plan is not None

    def begin(self, prompt: list[int], capacity: int, target_cache: KVCache | None = None) -> None:
        extra = self.shape.max_nodes() if self.shape else 0
        self.cache = self.model.new_cache(capacity + extra)
        self.pending = list(prompt)

    def propose(self, k: int, params: SamplingParams, generator: torch.Generator) -> Draft:
        """Draft up to depth ``k`` (the decode loop caps it near the token budget)."""
        self.round = _Round()
        if k == 0:
            return Draft(torch.empty(0, dtype=torch.long), None, ())
        ids = torch.tensor(self.pending, dtype=torch.long, device=self.model.device)
        catch_up_plan = None if self.calibrate else self.plan  # calibration: exact K/V for committed tokens
        logits = self.model(ids, self.cache, logits_for=slice(-1, None), plan=catch_up_plan).float()  # [1, Vd]
        self.pending = []
        self.round.base = self.cache.length
        shape = self.shape or TreeShape(widths=(1,) * k)
        tokens: list[int] = []
        parents: list[int] = []
        qs: list[torch.Tensor] = []
        frontier = [-1]  # nodes whose children are drafted from `logits` rows
        for depth in range(min(k, len(shape.widths))):
            expand = self._add_children(frontier, logits, depth, shape, params, generator, tokens, parents, qs)
            if not expand or depth + 1 == min(k, len(shape.widths)):
                break
            logits = self._forward_frontier(expand, tokens, parents)
            frontier = expand
        q = None if params.greedy else _pad_vocab(torch.stack(qs), self.target_vocab)
        return Draft(torch.tensor(tokens, dtype=torch.long), q, tuple(parents))

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

    def _forward_frontier(self, nodes: list[int], tokens: list[int], parents: list[int]) -> torch.Tensor:
        """Run frontier nodes through the draft in one forward; each sees the prefix + ancestors."""
        rnd = self.round
        start = self.cache.length
        depth_of = {n: _depth(n, parents) for n in nodes}
        positions = torch.tensor([rnd.base - 1 + depth_of[n] for n in nodes], device=self.model.device)
        chain = len(nodes) == 1 and len(rnd.slot) == depth_of[nodes[0]] - 1
        mask = None
        if not chain:
            mask = torch.zeros(len(nodes), start + len(nodes), dtype=torch.bool, device=self.model.device)
            mask[:, : rnd.base] = True
            for r, n in enumerate(nodes):
                mask[r, start + r] = True
                a = parents[n]
                while a >= 0:
                    mask[r, rnd.base + rnd.slot[a]] = True
                    a = parents[a]
        for r, n in enumerate(nodes):
            rnd.slot[n] = start - rnd.base + r
        ids = torch.tensor([tokens[n] for n in nodes], dtype=torch.long, device=self.model.device)
        return self.model(ids, self.cache, positions=positions, mask=mask, plan=self.plan).float()  # [F, Vd]

    def observe(self, n_accepted: int, new_tokens: list[int], path: list[int] | None = None) -> None:
        if path is None:
            path = list(range(n_accepted))
        rnd = self.round
        if not rnd.slot and rnd.base == 0:  # nothing drafted this round
            self.pending.extend(new_tokens)
            return
        kept = []
        for node in path:  # accepted nodes the draft already ran, in order (a prefix of `path`)
            if self.calibrate or node not in rnd.slot:
                break
            kept.append(rnd.slot[node])
        self.cache.commit(rnd.base, kept)
        self.pending = list(new_tokens[len(kept):])


class SelfDrafter(ModelDrafter):
    """SWIFT self-speculation: the target itself, with ``plan`` skipping sub-layers, drafts.

    It reads the target's KV cache for the committed prefix and writes its draft rows (only for
    the layers it runs) after it; before verification it rolls the cache back, and the verify
    forward rewrites those slots for every layer, which restores the exact state."""

    def __init__(self, model: CausalLM, plan: LayerPlan, shape: TreeShape | None = None) -> None:
        super().__init__(model, model.dims.vocab, shape, plan, calibrate=False)

    def reconfigure(self, shape: TreeShape | None, plan: LayerPlan | None, calibrate: bool) -> None:
        super().reconfigure(shape, plan, calibrate=False)  # the verify pass already restores exact K/V

    def begin(self, prompt: list[int], capacity: int, target_cache: KVCache | None = None) -> None:
        if target_cache is None:
            raise ValueError("a self-speculative drafter drafts into the target's cache; pass it to begin()")
        self.cache = target_cache
        self.pending = [prompt[-1]]  # the target cache holds everything before the last token

    def propose(self, k: int, params: SamplingParams, generator: torch.Generator) -> Draft:
        committed = self.cache.length
        try:
            return super().propose(k, params, generator)
        finally:
            self.cache.rollback(committed)

    def observe(self, n_accepted: int, new_tokens: list[int], path: list[int] | None = None) -> None:
        self.round = _Round()
        self.pending = [new_tokens[-1]]


def _depth(node: int, parents: list[int]) -> int:
    d = 0
    while node >= 0:
        node = parents[node]
        d += 1
    return d


def _pad_vocab(q: torch.Tensor, vocab: int) -> torch.Tensor:
    """A restricted draft head gives q over ids [0, n); tokens beyond have q = 0."""
    return q if q.shape[-1] == vocab else F.pad(q, (0, vocab - q.shape[-1]))
