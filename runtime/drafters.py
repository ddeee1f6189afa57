"""Drafting models (a draft model, or the target skipping layers) and the tree shapes they draft;
the contract they implement (``Draft``, ``Drafter``) is ``runtime.draft``."""
from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field, replace
from functools import lru_cache

import torch
import torch.nn.functional as F

from runtime.draft import Draft, DraftSteps, Forward, drive
from runtime.kv_cache import KVCache
from runtime.lookup import PromptLookupDrafter
from runtime.sampling import SamplingParams, logits_to_probs, reuse_or_draw, sample
from runtime.transformer import CausalLM
from runtime.tree import compile_tree
from search_spaces.layer_plan import LayerPlan
from search_spaces.strategy import LOOKUP_FIRST_MIN_NGRAM, Strategy, tree_node_bound


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

    def narrowed(self, width: int | None) -> "TreeShape":
        """This shape with at most ``width`` children per node (a batch under load drafts narrower
        trees, ``autotune.tuning.load``); ``None``: itself."""
        if width is None or max(self.widths, default=1) <= width:
            return self
        dynamic = None if self.dynamic is None else tuple((p, min(k, width)) for p, k in self.dynamic)
        return replace(self, widths=tuple(min(w, width) for w in self.widths), dynamic=dynamic)

    @property
    def is_chain(self) -> bool:
        """One node per depth (no widths above 1, no dynamic alternatives)."""
        return self.dynamic is None and all(w == 1 for w in self.widths)


def tree_shape(s: Strategy) -> TreeShape:
    """The draft tree a strategy asks for (a chain: width 1 at every depth)."""
    widths = s.tree_widths or (1,) * s.draft_length
    return TreeShape(widths=widths, dynamic=s.dynamic_widths, threshold=s.confidence_threshold)


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

    With ``lookup_first`` a round first tries prompt lookup over the sequence (an n-gram index it
    keeps in any case, so a switch needs no rebuild) where ``LOOKUP_FIRST_MIN_NGRAM`` or more
    tokens recur. A chain checks the copied continuation with the model (``_propose_checked``):
    the catch-up forward also runs the copy, each copied token is kept while the model would have
    drafted it, and the model drafts on from the first it would not have - the same draft (greedy;
    the same distribution when sampling) for fewer sequential draft forwards. A tree's round takes
    the copy alone as its draft (deterministic, ``q=None``) and the model drafts nothing; the
    committed tokens then wait as ``pending`` for its next catch-up.
    """

    def __init__(
        self, model: CausalLM, target_vocab: int, shape: TreeShape | None = None,
        plan: LayerPlan | None = None, calibrate: bool = True, lookup_first: bool = False,
    ) -> None:
        self.model = model
        self.lookup = PromptLookupDrafter(min_ngram=LOOKUP_FIRST_MIN_NGRAM, max_ngram=LOOKUP_FIRST_MIN_NGRAM)
        self.lookup_first = lookup_first
        self.lookup_rounds = 0  # rounds that started from a lookup copy (``lookup_first``)
        self.copied_kept = 0  # copied tokens a chain's check kept: draft forwards saved
        self.target_vocab = target_vocab
        self.shape = shape
        self.width_cap: int | None = None  # children per node this round at most (None: the shape's)
        self.plan = None if plan is None or plan.is_identity else plan
        self.calibrate = calibrate and self.plan is not None
        self.cache = model.new_cache(1)  # a placeholder (a self-drafter's model is the target: never its live cache)
        self.pending: list[int] = []
        self.round = _Round()
        self.catch_up_width = 1  # compiled catch-up forwards are padded to this many rows (<= k + 1)
        # the tokens whose exact K/V fill the cache's leading rows: the next prompt's common
        # prefix with them is kept instead of prefilled again (few-shot prompts share theirs)
        self.exact_rows: list[int] = []

    def reconfigure(self, strategy: Strategy) -> None:
        """Draft with ``strategy``'s tree, layer plan and calibration from the next round on,
        keeping the cache (online tuning)."""
        self.shape = tree_shape(strategy)
        self.plan = None if strategy.layer_plan is None or strategy.layer_plan.is_identity else strategy.layer_plan
        self.calibrate = strategy.calibrate and self.plan is not None
        self.lookup_first = strategy.lookup_first

    def sync(self) -> None:
        """Run the committed tokens the draft has not seen, all but the last (whose logits start
        the next draft), exactly: the cache then follows the sequence, as a tuner scoring this
        draft on the latest tokens needs while decoding goes on without it (plain decoding)."""
        if len(self.pending) < 2:
            return
        with torch.inference_mode():
            self._run_exact(self.pending[:-1], slice(-1, None))
        self.pending = self.pending[-1:]

    def sync_scoring(self, tokens: list[int], window: int) -> torch.Tensor | None:
        """``sync`` up to ``tokens`` that also scores: the catch-up forward's logits at the last
        ``window`` positions ``[w, Vd]`` (row i predicts ``tokens[n - w + i]``), i.e. the draft's
        own (all layers) predictions of the window, for the price of the catch-up alone.
        ``tokens`` is a prefix of the sequence the draft follows; committed tokens after it stay
        pending. None when the cache already holds the window's inputs, or ``tokens`` is not such
        a prefix."""
        n = len(tokens)
        w = min(window, n - 1)
        start = n - w - 1  # the input predicting the window's first token
        held = self.cache.length
        # ``tokens`` must be a prefix of the sequence followed (cache rows + pending) reaching past the rows
        if w < 1 or held > start or n > held + len(self.pending) or tokens[held:] != self.pending[: n - held]:
            return None
        with torch.inference_mode():
            if start > held:
                self._run_exact(tokens[held:start], slice(-1, None))
            logits = self._run_exact(tokens[start : n - 1], None).float()
        self.pending = self.pending[n - 1 - held:]
        return logits

    def _run_exact(self, ids: list[int], logits_for: slice | None) -> torch.Tensor:
        """Committed tokens through every layer into the cache, tracked as exact rows."""
        if self.cache.length == len(self.exact_rows):
            self.exact_rows.extend(ids)
        t = torch.tensor(ids, dtype=torch.long, device=self.model.device)
        if logits_for is None:
            return self.model(t, self.cache)
        return self.model(t, self.cache, logits_for=logits_for)

    def begin(self, prompt: list[int], capacity: int, target_cache: KVCache | None = None) -> None:
        """A new sequence. The leading cache rows it shares with the previous one (exact K/V of
        the same tokens at the same positions) are kept, not prefilled again - except with
        compiled steps, where the rest of the prompt would be a step of a new shape each time
        (a recompile) instead of the eager prefill."""
        # a round's rows: its drafted nodes; a checked lookup copy runs up to the draft length + 1 more
        extra = 2 * (self.shape.max_nodes() + 1) if self.shape else 0
        need = capacity + extra
        keep = 0
        limit = 0 if self.model.is_compiled else min(len(self.exact_rows), len(prompt) - 1, self.cache.length)
        while keep < limit and self.exact_rows[keep] == prompt[keep]:
            keep += 1
        if keep and self.cache.capacity >= need:
            self.cache.rollback(keep)
        else:
            old, self.cache = self.cache, self.model.new_cache(need, reuse=True)
            if keep:
                self.cache.all_keys[:, :, :keep] = old.all_keys[:, :, :keep]
                self.cache.all_values[:, :, :keep] = old.all_values[:, :, :keep]
                self.cache.length = keep
        del self.exact_rows[keep:]
        self.pending = list(prompt[keep:])
        self.lookup.begin(prompt, capacity)

    def propose(self, k: int, params: SamplingParams, generator: torch.Generator) -> Draft:
        """Draft up to depth ``k`` (the decode loop caps it near the token budget)."""
        return drive(self.propose_steps(k, params, generator))

    def propose_steps(self, k: int, params: SamplingParams, generator: torch.Generator) -> DraftSteps:
        """:meth:`propose` as steps: yields each draft-model forward it needs (``Forward``), is
        sent that forward's logits, returns the draft; a batch runs the forwards of several
        sequences' drafters in one (``runtime.batching``)."""
        self.round = _Round()
        if k == 0:
            return Draft(torch.empty(0, dtype=torch.long), None, ())
        full, self.shape = self.shape, (self.shape.narrowed(self.width_cap) if self.shape else None)
        try:
            return (yield from self._propose_shaped(k, params, generator))
        finally:
            self.shape = full

    def _propose_shaped(self, k: int, params: SamplingParams, generator: torch.Generator) -> DraftSteps:
        copy: list[int] = []
        if self.lookup_first:
            copied = self.lookup.propose(k, params, generator)
            if copied.tokens.numel():
                self.lookup_rounds += 1
                if not self.checks_copies:
                    return copied  # the model drafts nothing: ``observe`` queues the round's tokens
                copy = copied.tokens.tolist()
        # what a round appends at most: the deepest draft the shape allows, + 1
        self.catch_up_width = max(self.catch_up_width, (len(self.shape.widths) if self.shape else k) + 1)
        if copy:
            return (yield from self._propose_checked(copy, k, params, generator))
        logits = yield from self._catch_up()  # [1, Vd]
        self.round.base = self.cache.length
        shape = self.shape or TreeShape(widths=(1,) * k)
        widths = shape.widths[: min(k, len(shape.widths))]
        if shape.dynamic is None and shape.threshold <= 0:
            return (yield from self._propose_static(widths, logits, params, generator))
        return (yield from self._propose_adaptive(shape, len(widths), logits, params, generator))

    def _catch_up(self, copy: list[int] | None = None) -> Generator[Forward, torch.Tensor, torch.Tensor]:
        """Run the committed tokens the draft has not seen -> the last one's logits ``[1, Vd]``;
        with ``copy`` (a lookup copy to check) its tokens run after them in the same forward ->
        ``[1 + len(copy), Vd]``, row ``d`` predicting copy token ``d`` (the last, the token after
        the copy). Compiled, the rows are padded to a fixed width (the draft length + 1, twice
        that with a copy) and the padding rolled back, so the step keeps one of two shapes."""
        copy = copy or []
        n = len(self.pending)
        ids = torch.tensor(self.pending + copy, dtype=torch.long, device=self.model.device)
        plan = None if self.calibrate else self.plan  # calibration: exact K/V for committed tokens
        if plan is None and self.cache.length == len(self.exact_rows):
            self.exact_rows.extend(self.pending)
        self.pending = []
        rows = n + len(copy)
        padded = self.catch_up_width * (2 if copy else 1)
        width = max(rows, padded) if self.model.is_compiled and self.cache.length else rows
        if width == rows:
            return (yield Forward(self.model, ids, self.cache, logits_for=slice(n - 1, None), plan=plan)).float()
        start = self.cache.length
        ids = torch.cat([ids, ids[-1:].expand(width - rows)])
        logits = yield Forward(self.model, ids, self.cache, plan=plan)
        self.cache.rollback(start + rows)
        return logits[n - 1 : rows].float()

    @property
    def checks_copies(self) -> bool:
        """Whether a lookup copy is checked by the model (chains) or drafted alone (trees)."""
        return self.shape is None or self.shape.is_chain

    def _propose_checked(self, copy: list[int], k: int, params: SamplingParams, gen: torch.Generator) -> DraftSteps:
        """A chain round from a lookup copy. One forward runs the pending tokens and the copy;
        depth by depth, the copied token is kept where the model would have drafted it (greedy:
        it is the argmax; sampling: ``reuse_or_draw``, so each depth is still drawn from the
        draft's own distribution ``q``), and from the first depth where it is not, the copy's
        rows are rolled back and the model drafts on as usual (threshold included). Greedy, the
        draft is token for token the one the model alone would propose; each kept token saves
        one sequential draft forward. ``copied_kept`` counts them."""
        shape = self.shape or TreeShape(widths=(1,) * k)
        depth_max = min(k, len(shape.widths))
        copy = copy[:depth_max]
        rows = yield from self._catch_up(copy)  # [len(copy) + 1, Vd]
        rnd = self.round
        rnd.base = self.cache.length - len(copy)
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        logits = rows[0]
        copying = True
        for depth in range(depth_max):
            if depth > 0 and shape.threshold > 0 and float(torch.softmax(logits, -1).max()) < shape.threshold:
                break
            q = logits_to_probs(logits, params)  # [Vd]
            if copying and depth < len(copy) and copy[depth] < q.shape[-1]:
                tok, kept = reuse_or_draw(q, copy[depth], gen)
            else:
                tok = int(torch.argmax(q)) if params.greedy else int(sample(q, gen))
                kept = False
            tokens.append(tok)
            if not params.greedy:
                qs.append(q)
            if kept:  # its row is the copy's: the next depth's logits are already computed
                rnd.slot[depth] = depth
                self.copied_kept += 1
                logits = rows[depth + 1]
                continue
            if copying:
                copying = False
                self.cache.rollback(rnd.base + depth)  # the copy's rows from here on are not the draft's
            if depth + 1 == depth_max:
                break
            logits = (yield Forward(self.model, torch.tensor([tok], device=self.model.device), self.cache,
                                    plan=self.plan)).float()[0]
            rnd.slot[depth] = depth
        self.cache.rollback(rnd.base + len(rnd.slot))  # kept copy rows past a threshold stop
        q_all = None if params.greedy else _pad_vocab(torch.stack(qs), self.target_vocab)
        return Draft(torch.tensor(tokens, dtype=torch.long, device=self.model.device), q_all, None)

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
        q = None if params.greedy else _pad_vocab(torch.cat(qs), self.target_vocab)
        return Draft(torch.cat(tokens), q, layout.parents)

    def draft_depth(
        self, frontier: torch.Tensor, depth: int, layout: "StaticLayout"
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
        q = None if params.greedy else _pad_vocab(torch.stack(qs), self.target_vocab)
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
        depth_of = {n: _depth(n, parents) for n in nodes}
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

    def observe(self, n_accepted: int, new_tokens: list[int], path: list[int] | None = None) -> None:
        self.lookup.observe(n_accepted, new_tokens)
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
        del self.exact_rows[self.cache.length:]
        self.pending = list(new_tokens[len(kept):])
        self.round = _Round()  # a drafter kept on standby next round observes without drafting


class SelfDrafter(ModelDrafter):
    """SWIFT self-speculation: the target itself, with ``plan`` skipping sub-layers, drafts.

    It reads the target's KV cache for the committed prefix and writes its draft rows (only for
    the layers it runs) after it; before verification it rolls the cache back, and the verify
    forward rewrites those slots for every layer, which restores the exact state."""

    def __init__(self, model: CausalLM, plan: LayerPlan, shape: TreeShape | None = None) -> None:
        super().__init__(model, model.dims.vocab, shape, plan, calibrate=False)

    def reconfigure(self, strategy: Strategy) -> None:
        super().reconfigure(strategy)
        self.calibrate = False  # the verify pass already restores exact K/V

    def sync(self) -> None:
        """Nothing to catch up: the target's cache is the draft's."""

    def begin(self, prompt: list[int], capacity: int, target_cache: KVCache | None = None) -> None:
        if target_cache is None:
            raise ValueError("a self-speculative drafter drafts into the target's cache; pass it to begin()")
        self.cache = target_cache
        self.pending = [prompt[-1]]  # the target cache holds everything before the last token
        self.exact_rows = []  # the target's cache: nothing of its own to keep across sequences

    def propose_steps(self, k: int, params: SamplingParams, generator: torch.Generator) -> DraftSteps:
        committed = self.cache.length
        try:
            return (yield from super().propose_steps(k, params, generator))
        finally:
            self.cache.rollback(committed)

    def observe(self, n_accepted: int, new_tokens: list[int], path: list[int] | None = None) -> None:
        self.round = _Round()
        self.pending = [new_tokens[-1]]


@dataclass(frozen=True)
class StaticLayout:
    """A fixed-width draft tree in breadth-first order: its parents and, per drafted depth, the
    mask block of that depth's frontier over the round's rows so far (``[F, R]``, device)."""

    parents: tuple[int, ...]
    frontier_masks: tuple[torch.Tensor, ...]
    chain: bool


@lru_cache(maxsize=64)
def _static_layout(widths: tuple[int, ...], device: str) -> StaticLayout:
    parents: list[int] = []
    level = [-1]
    starts = []
    for w in widths:
        starts.append(len(parents))
        nxt = []
        for node in level:
            for _ in range(w):
                nxt.append(len(parents))
                parents.append(node)
        level = nxt
    tree = compile_tree(tuple(parents))
    seen = tree.mask[1:, 1:]  # [N, N] node -> itself and its ancestors
    masks = []
    for d in range(len(widths) - 1):  # depth d's nodes run to draft depth d + 1
        lo, hi = starts[d], starts[d + 1]
        masks.append(seen[lo:hi, :hi].to(device))
    return StaticLayout(tuple(parents), tuple(masks), all(w == 1 for w in widths))


def static_layout(widths: tuple[int, ...], device: torch.device | str) -> StaticLayout:
    return _static_layout(tuple(widths), str(device))


def _depth(node: int, parents: list[int]) -> int:
    d = 0
    while node >= 0:
        node = parents[node]
        d += 1
    return d


def _pad_vocab(q: torch.Tensor, vocab: int) -> torch.Tensor:
    """A restricted draft head gives q over ids [0, n); tokens beyond have q = 0."""
    return q if q.shape[-1] == vocab else F.pad(q, (0, vocab - q.shape[-1]))
