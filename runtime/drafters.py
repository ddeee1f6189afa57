"""Drafting models (a draft model, or the target skipping layers): the Drafter-protocol object
that owns the draft model's cache for a sequence (``ModelDrafter``) and hands each round to a
round drafter - chains ``runtime.chain_drafting``, trees ``runtime.tree_drafting``, either
wrapped by ``runtime.lookup_first``. The contract is ``runtime.draft``."""
from __future__ import annotations

from collections.abc import Generator, Sequence

import torch

from runtime.chain_drafting import ChainDrafter
from runtime.draft import CatchesUp, Draft, DraftSteps, Forward, KeepsRows, Narrows, Stepped, drive
from runtime.draft_rounds import DraftRound, RoundDrafter
from runtime.draft_shapes import StaticLayout, TreeShape, static_layout, tree_shape
from runtime.kv_cache import KVCache
from runtime.lookup import PromptLookupDrafter
from runtime.lookup_first import LookupFirst
from runtime.prefix_cache import PrefixCache
from runtime.sampling import SamplingParams
from runtime.transformer import CausalLM
from runtime.tree_drafting import TreeDrafter
from search_spaces.layer_plan import LayerPlan
from search_spaces.strategy import LOOKUP_FIRST_MIN_NGRAM, Strategy

__all__ = [
    "Draft", "ModelDrafter", "SelfDrafter", "StaticLayout", "TreeShape", "static_layout", "tree_shape",
]


class ModelDrafter(Stepped, CatchesUp, Narrows, KeepsRows):
    """Drafts a chain or a token tree with a smaller model of the same family (own KV cache).

    It owns the sequence's draft state - the cache (a prefix of the committed sequence plus this
    round's drafted rows), ``pending`` committed tokens the draft has not seen yet, the prompt-lookup
    index - and each round hands it to a round drafter chosen by the round's shape: a
    ``ChainDrafter`` or a ``TreeDrafter``, wrapped by ``LookupFirst`` with ``lookup_first``.
    Switching strategies (``reconfigure``) keeps the state and picks the round drafter anew.

    With a layer ``plan`` the drafted rows run under it (fuzzy groups, skipped sub-layers). With
    ``calibrate`` (EasySpec bonus calibration) every drafted row is discarded after verification
    and the committed tokens (accepted + bonus) are re-run exactly in one forward, whose last
    logits give the next round's first draft token; without it, the accepted rows' fuzzy K/V
    are kept and the remaining tokens run under the plan too.
    """

    def __init__(
        self, model: CausalLM, target_vocab: int, shape: TreeShape | None = None,
        plan: LayerPlan | None = None, calibrate: bool = True, lookup_first: bool = False,
    ) -> None:
        self.model = model
        self.lookup = PromptLookupDrafter(min_ngram=LOOKUP_FIRST_MIN_NGRAM, max_ngram=LOOKUP_FIRST_MIN_NGRAM)
        self.lookup_first = lookup_first
        self.chain, self.tree = ChainDrafter(), TreeDrafter()
        self.copying_chain, self.copying_tree = LookupFirst(self.lookup, self.chain), LookupFirst(self.lookup, self.tree)
        self.target_vocab = target_vocab
        self.shape = shape
        self.width_cap: int | None = None  # children per node this round at most (None: the shape's)
        self.plan = None if plan is None or plan.is_identity else plan
        self.calibrate = calibrate and self.plan is not None
        self.cache = model.new_cache(1)  # a placeholder (a self-drafter's model is the target: never its live cache)
        self.pending: list[int] = []
        self.round = DraftRound()
        self.catch_up_width = 1  # compiled catch-up forwards are padded to this many rows (<= k + 1)
        # the tokens whose exact K/V fill the cache's leading rows: the next prompt's common
        # prefix with them is kept instead of prefilled again (few-shot prompts share theirs)
        self.exact_rows: list[int] = []

    @property
    def lookup_rounds(self) -> int:
        """Rounds that started from a lookup copy (``lookup_first``)."""
        return self.copying_chain.rounds + self.copying_tree.rounds

    @property
    def copied_kept(self) -> int:
        """Copied tokens a chain's check kept: draft forwards saved."""
        return self.chain.copied_kept

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

    def reuse_rows(self, prefix: PrefixCache, chunk: int) -> int:
        """After ``begin``: the sequence's leading draft rows from ``prefix`` where it holds more of
        them than this drafter kept (only where this model's rows are reusable: its catch-up runs
        the prompt in pieces of its own, not in prefill chunks) -> rows gained."""
        if not self.model.rows_reusable or self.model.is_compiled:
            return 0
        tokens = self.exact_rows + self.pending
        gained = prefix.reuse(self.model, tokens, self.cache, chunk, len(tokens) - 1, counted=False)
        if gained:
            n = self.cache.length
            self.exact_rows, self.pending = tokens[:n], tokens[n:]
        return gained

    def offer_rows(self, prefix: PrefixCache, chunk: int) -> None:
        """This model's exact rows (run through every layer) to ``prefix``, for later sequences."""
        if self.model.rows_reusable and not self.model.is_compiled:
            n = min(len(self.exact_rows), self.cache.length)
            prefix.offer(self.model, self.exact_rows, self.cache, n, chunk)

    def forget_rows(self) -> None:
        """The next sequence starts from no kept rows (``begin`` keeps none of this one's)."""
        self.exact_rows.clear()

    def propose(self, k: int, params: SamplingParams, generator: torch.Generator) -> Draft:
        """Draft up to depth ``k`` (the decode loop caps it near the token budget)."""
        return drive(self.propose_steps(k, params, generator))

    def propose_steps(self, k: int, params: SamplingParams, generator: torch.Generator) -> DraftSteps:
        """:meth:`propose` as steps: yields each draft-model forward it needs (``Forward``), is
        sent that forward's logits, returns the draft; a batch runs the forwards of several
        sequences' drafters in one (``runtime.batching``)."""
        self.round = DraftRound()
        if k == 0:
            return Draft(torch.empty(0, dtype=torch.long), None, ())
        shape = (self.shape or TreeShape(widths=(1,) * k)).narrowed(self.width_cap)
        return (yield from self._round_drafter(shape).propose(self, shape, k, params, generator))

    def _round_drafter(self, shape: TreeShape) -> RoundDrafter:
        if shape.is_chain:
            return self.copying_chain if self.lookup_first else self.chain
        return self.copying_tree if self.lookup_first else self.tree

    def catch_up(self, depth: int, copy: Sequence[int] = ()) -> Generator[Forward, torch.Tensor, torch.Tensor]:
        """Run the committed tokens the draft has not seen -> the last one's logits ``[1, Vd]``;
        with ``copy`` (a lookup copy to check) its tokens run after them in the same forward ->
        ``[1 + len(copy), Vd]``, row ``d`` predicting copy token ``d`` (the last, the token after
        the copy). Compiled, the rows are padded to a fixed width (the deepest ``depth`` drafted
        yet + 1, twice that with a copy) and the padding rolled back, so the step keeps one of two
        shapes."""
        self.catch_up_width = max(self.catch_up_width, depth + 1)
        n = len(self.pending)
        ids = torch.tensor(self.pending + list(copy), dtype=torch.long, device=self.model.device)
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
        self.round = DraftRound()  # a drafter kept on standby next round observes without drafting


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

    def reuse_rows(self, prefix: PrefixCache, chunk: int) -> int:
        return 0  # the target's cache: its decoder reuses those rows

    def offer_rows(self, prefix: PrefixCache, chunk: int) -> None:
        """Nothing of its own: the target's rows go back through its decoder."""

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
        self.round = DraftRound()
        self.pending = [new_tokens[-1]]


