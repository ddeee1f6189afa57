"""The decode loop: prefill (``runtime.sequence``), then rounds of draft -> verify (one target
forward) -> commit.

With no drafter every round is a single-token target forward, i.e. plain decoding through the
same code path.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass

import torch

from runtime.draft import CatchesUp, Draft, Drafter, DraftSteps, KeepsRows, Narrows, Stepped, drive
from runtime.errors import RuntimeUserError
from runtime.kv_cache import KVCache
from runtime.layout import Layout, PromptChunk
from runtime.prefix_cache import PrefixCache
from runtime.sampling import SamplingParams, accept_chain, accept_chain_greedy, logits_to_probs
from runtime.sequence import (  # noqa: F401  (GenerationResult, check_fits: imported from here too)
    GenerationConfig, GenerationResult, Sequence, check_fits, keep_rows, prefill_steps,
)
from runtime.stats import DecodeStats
from runtime.transformer import CausalLM
from runtime.tree import CompiledTree, compile_tree, tree_tables
from runtime.tree_verify import accept_tree, accept_tree_greedy, read_tree_result
from search_spaces.strategy import Strategy


RoundHook = Callable[["Decoder", list[int], KVCache, DecodeStats], None]
# called with every new token so far after the prefill and after each round; True stops decoding
# there (a stop string seen, a client gone): what a server streams from
TokensHook = Callable[[list[int]], bool]


@dataclass(frozen=True)
class VerifyRows:
    """The target rows of one verify pass (``Decoder.rows``)."""

    ids: torch.Tensor  # [T] cur + draft tokens (+ padding)
    n: int  # rows that count: 1 + draft tokens
    base: int  # cache length before the pass
    tree: CompiledTree | None = None  # a branched draft (None: a chain, causal rows)
    positions: torch.Tensor | None = None  # a tree's depth positions
    rel_mask: torch.Tensor | None = None  # a tree's mask block


class Decoder:
    """Greedy or sampled decoding of one target, optionally speculating with ``drafter``.

    ``standby`` holds further drafters by strategy drafter kind (``strategy.drafter``): they are
    not drafting, but they follow the sequence (each round's tokens reach them too), so
    ``apply(strategy)`` can switch to any of them between rounds without losing state - how the
    online tuner moves between plain decoding, a draft model, prompt lookup and self-drafting."""

    def __init__(
        self, target: CausalLM, drafter: Drafter | None = None, draft_length: int = 0, verify_width: int = 0,
        kind: str | None = None,
    ) -> None:
        self.target = target
        self.drafter = drafter
        self.kind = kind if drafter is not None else None  # the active drafter's kind (None: unnamed / plain)
        self.standby: dict[str, Drafter] = {}
        self.draft_length = draft_length if drafter is not None else 0
        # the widest verify pass; it is padded to this many rows where ``pads`` (a target packed for
        # that width, or compiled for static shapes); otherwise it runs the drafted rows only, since
        # a quantised target's verify costs grow with every row
        self.verify_width = max(verify_width, self.draft_length + 1) if drafter is not None else 1
        self.pads = True
        self.last_rows = 0  # target rows of the last round's verify pass (1 + drafted; padding not counted)
        self.step_cap: int | None = None  # drafts at most this many tokens next round (None: its strategy's length)
        self.step_width: int | None = None  # a tree drafts at most this many children per node next round
        # K/V rows of earlier sequences (``runtime.prefix_cache``): a prompt's leading rows come from it,
        # exactly as its own prefill would compute them, and each sequence's rows go back (a server's)
        self.prefix: PrefixCache | None = None

    def drafter_of(self, kind: str) -> Drafter | None:
        """The drafter of this kind, drafting or on standby (None when the decoder has none)."""
        return self.drafter if kind == self.kind else self.standby.get(kind)

    def apply(self, strategy: Strategy) -> None:
        """Decode with ``strategy`` from the next round on: switch to its drafter kind (plain
        decoding: no drafter) and reconfigure it. Every drafter kind the strategy may need must be
        on the decoder already (``build_decoder(..., standby=...)``); the verify width is fixed."""
        kind = strategy.drafter if strategy.speculates else None
        if kind is not None and kind != self.kind and kind not in self.standby:
            have = sorted({*self.standby, *([self.kind] if self.kind else [])})
            raise RuntimeUserError(
                f"this decoder has no '{kind}' drafter (it has: {', '.join(have) or 'none'}); build it with that "
                "drafter on standby"
            )
        if strategy.speculates and strategy.max_tree_nodes + 1 > self.verify_width:
            raise RuntimeUserError(
                f"a strategy with {strategy.max_tree_nodes} draft nodes does not fit this decoder's verify width "
                f"{self.verify_width}"
            )
        if kind != self.kind:
            if self.drafter is not None:
                if self.kind is None:
                    raise RuntimeUserError("the decoder's drafter has no kind; it cannot be put on standby")
                self.standby[self.kind] = self.drafter
            self.drafter = self.standby.pop(kind) if kind is not None else None
            self.kind = kind
        if self.drafter is not None:
            self.drafter.reconfigure(strategy)
        self.draft_length = strategy.draft_length if strategy.speculates else 0

    def _following(self) -> list[Drafter]:
        """Every drafter of this decoder, the drafting one first."""
        return ([self.drafter] if self.drafter is not None else []) + list(self.standby.values())

    def check_fits(self, prompt_len: int, config: GenerationConfig) -> None:
        check_fits(prompt_len, config.max_new_tokens, self.target.dims.max_positions)

    def start(self, prompt: list[int], config: GenerationConfig) -> Sequence:
        """Prefill ``prompt`` (its first new token) and start every drafter on it: the state
        :meth:`generate` then advances round by round (or a batch, ``runtime.batching``)."""
        steps = self.start_steps(prompt, config)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def start_steps(
        self, prompt: list[int], config: GenerationConfig
    ) -> Generator[PromptChunk, tuple[torch.Tensor, float] | None, Sequence]:
        """:meth:`start` a chunk at a time: the prompt is prefilled in forwards of at most
        ``config.prefill_chunk`` tokens. Before each chunk this yields it (``PromptChunk``: its rows
        on the sequence's cache, causal, logits for its last row); the caller sends back None (the
        decoder runs the chunk alone, between whatever else the caller runs) or ``(logits,
        seconds)``: it ran the chunk's part in a forward of its own (a server's batched step,
        ``runtime.batching.batch_round``; only on a target whose rows are reusable, which computes
        them bit for bit as alone) and that forward's share of the time. Returns the started
        sequence. The rows a prefix cache (``prefix``) holds are not prefilled; with
        ``config.cache_prompt`` off, neither the prefix cache's rows nor those a drafting model kept
        from the last sequence are used. A prompt that does not fit: an error."""
        self.check_fits(len(prompt), config)
        capacity = len(prompt) + config.max_new_tokens + self.verify_width + 2
        prefix = self.prefix if config.cache_prompt else None
        if not config.cache_prompt:  # no rows of an earlier sequence: the drafting models' own neither
            self.forget_rows()
        return (yield from prefill_steps(self.target, self._following(), prefix, prompt, config, capacity, self))

    def remember(self, seq: Sequence) -> None:
        """Keep ``seq``'s committed rows, and its drafting models', in the prefix cache (where it has
        one and ``cache_prompt`` is on): ``generate`` at its end, a server as a request leaves."""
        if self.prefix is not None and seq.config.cache_prompt:
            keep_rows(self.target, self._following(), self.prefix, seq)

    def forget_rows(self) -> None:
        """Its drafting models keep none of their rows for the next sequence: it starts from the prefix
        cache alone (a server's cache reset)."""
        for drafter in self._following():
            if isinstance(drafter, KeepsRows):
                drafter.forget_rows()

    def catch_up_rows(self) -> int:
        """Tokens the drafting model has yet to run before it drafts (its catch-up; 0 without one)."""
        return len(self.drafter.pending) if isinstance(self.drafter, CatchesUp) else 0

    def draft_prefill(self, seq: Sequence) -> int:
        """The drafting model's own prefill: the prompt through the drafter of the first round (its
        catch-up, which that round would otherwise run), timed as prefill, once per request, after
        the first token is out. Every way a sequence is decoded calls it after ``start`` (a
        server's worker before the first step the request drafts in). Drafters on standby catch up
        when next used; nothing to do once the sequence is finished. -> the tokens the drafting
        model ran (0: nothing to catch up on, or no drafting model)."""
        drafter = self.drafter
        if not isinstance(drafter, CatchesUp) or self.draft_length < 1 or seq.finished:
            return 0
        pending = len(drafter.pending)
        started = time.perf_counter()
        drafter.sync()
        seq.stats.prefill_s += time.perf_counter() - started
        return max(pending - len(drafter.pending), 0)

    def generate(
        self, prompt: list[int], config: GenerationConfig, before_round: RoundHook | None = None,
        after_round: TokensHook | None = None,
    ) -> GenerationResult:
        """Decode ``prompt``. ``before_round(decoder, tokens, cache, stats)`` runs before every
        draft/verify round (the online tuner: it may score candidates and reconfigure the drafter);
        ``after_round(new_tokens)`` after the prefill and every round (streaming; returning True
        stops). Decoding stops at the first EOS, even one accepted inside a round. With a prefix
        cache, the sequence's rows are kept for later prompts (``remember``)."""
        seq = self.start(prompt, config)
        out, cache, stats = seq.out, seq.cache, seq.stats
        stop = after_round is not None and after_round(out)
        if not stop:
            self.draft_prefill(seq)
        while not stop and not seq.finished:
            if before_round is not None:  # outside inference mode: a tuner may need autograd (GP fitting)
                before_round(self, prompt + out, cache, stats)
            with torch.inference_mode():
                out.extend(self._round(out, cache, config, seq.gen, stats, seq.eos))
            stop = after_round is not None and after_round(out)
        self.remember(seq)
        return seq.result()

    def _round(
        self, out: list[int], cache: KVCache, config: GenerationConfig, gen: torch.Generator, stats: DecodeStats,
        eos: frozenset[int] = frozenset(),
    ) -> list[int]:
        """One draft -> verify -> commit round; returns the tokens it appends (>= 1), ending at
        the first EOS among them: tokens after an EOS inside an accepted run are dropped, and the
        stats count only the accepted drafts that are returned.

        Drafting, verification and acceptance stay on the device; the round reads back once (the
        accepted count, path and tokens, in one ``tolist``)."""
        t0 = time.perf_counter()
        draft = self.propose(out, config, gen)
        t1 = time.perf_counter()
        if draft.is_chain:
            path, new_tokens = self._verify_chain(out[-1], draft, cache, config.sampling, gen)
        else:
            path, new_tokens = self._verify_tree(out[-1], draft, cache, config.sampling, gen)
        stats.draft_s += t1 - t0
        stats.verify_s += time.perf_counter() - t1
        return self.conclude(draft, path, new_tokens, stats, eos)

    def propose(self, out: list[int], config: GenerationConfig, gen: torch.Generator) -> Draft:
        """This round's draft (empty for plain decoding), at most what the token budget leaves."""
        return drive(self.propose_steps(out, config, gen))

    def propose_steps(self, out: list[int], config: GenerationConfig, gen: torch.Generator) -> DraftSteps:
        """:meth:`propose` as steps (``runtime.draft.Forward``): a drafter without steps (prompt
        lookup) proposes at once."""
        k = min(self.draft_length, config.max_new_tokens - len(out) - 1)  # a round adds <= k + 1
        if self.step_cap is not None:  # a batch under load drafts less (autotune.tuning.load)
            k = min(k, self.step_cap)
        if self.drafter is None:
            return _no_draft()
        if isinstance(self.drafter, Narrows):  # a batch under load drafts narrower trees
            self.drafter.width_cap = self.step_width
        if not isinstance(self.drafter, Stepped):
            return self.drafter.propose(k, config.sampling, gen)
        return (yield from self.drafter.propose_steps(k, config.sampling, gen))

    def conclude(
        self, draft: Draft, path: list[int], new_tokens: list[int], stats: DecodeStats, eos: frozenset[int]
    ) -> list[int]:
        """After verification: cut at the first EOS, tell the drafters, count the round."""
        end = _first_eos(new_tokens, eos)
        cut = end <= len(path)  # an accepted draft is an EOS: the sequence ends inside this round
        new_tokens, path = new_tokens[:end], path[:end]
        if self.drafter is not None:
            self.drafter.observe(len(path), new_tokens, path)
        for waiting in self.standby.values():  # drafters on standby follow the sequence
            waiting.observe(0, new_tokens, [])
        stats.target_forwards += 1
        self.last_rows = 1 + int(draft.tokens.numel())
        stats.record_rows(self.last_rows)
        if draft.tokens.numel():
            _record_round(stats, draft, len(path), cut)
        return new_tokens

    def rows(
        self, cur: int, draft: Draft, cache: KVCache, pad: bool | None = None, as_tree: bool | None = None
    ) -> VerifyRows:
        """The target rows verifying ``draft``: ``cur`` + the draft tokens, with a tree's depth
        positions and mask block (``as_tree``: default, unless the draft is a chain). ``pad``
        (default: the decoder's ``pads``): padded to the fixed verify width (static shapes; cheap
        packed GEMMs on CPU); padding rows see only the prefix and themselves and are dropped."""
        dev = self.target.device
        n = 1 + int(draft.tokens.numel())
        ids = torch.cat([torch.tensor([cur], device=dev), draft.tokens.to(dev)])
        pad = self.pads if pad is None else pad
        extra = max(0, self.verify_width - n) if n > 1 and pad else 0  # nothing drafted: a single-row step
        ids = torch.cat([ids, ids[-1:].expand(extra)])
        if not (as_tree if as_tree is not None else not draft.is_chain):
            return VerifyRows(ids, n, cache.length)
        assert draft.parents is not None
        tree = compile_tree(tuple(draft.parents))
        tables = tree_tables(tree, dev, extra)
        return VerifyRows(ids, n, cache.length, tree, tables.offsets + cache.length, tables.block)

    def accept(
        self, rows: VerifyRows, logits: torch.Tensor, draft: Draft, cache: KVCache, params: SamplingParams,
        gen: torch.Generator,
    ) -> tuple[list[int], list[int]]:
        """Accept from the verify logits ``[1 + N, V]`` (float32) and roll the cache back to the
        accepted rows -> (accepted draft / node indices, appended tokens). Reads back once."""
        return self.settle(rows, self.judge(rows, logits, draft, params, gen).tolist(), cache)

    @staticmethod
    def judge(
        rows: VerifyRows, logits: torch.Tensor, draft: Draft, params: SamplingParams, gen: torch.Generator
    ) -> torch.Tensor:
        """The acceptance rule on the device -> its packed result (a 1-d long tensor whose length
        the shapes fix: a batch reads every member's in one ``tolist``)."""
        if rows.tree is None:
            if params.greedy:
                return accept_chain_greedy(logits.argmax(dim=-1), draft.tokens)
            return accept_chain(logits_to_probs(logits, params), draft.q, draft.tokens, gen)
        if params.greedy:
            return accept_tree_greedy(logits.argmax(dim=-1), rows.tree, draft.tokens)
        return accept_tree(logits_to_probs(logits, params), rows.tree, draft.tokens, draft.q, gen)

    @staticmethod
    def settle(rows: VerifyRows, got: list[int], cache: KVCache) -> tuple[list[int], list[int]]:
        """The read-back result of :meth:`judge` -> (accepted indices, appended tokens); keeps the
        accepted rows in the cache."""
        if rows.tree is None:
            n_acc = got[0]
            cache.rollback(rows.base + 1 + n_acc)  # keep cur + accepted drafts; the last token is next round's input
            return list(range(n_acc)), got[1 : n_acc + 2]
        path, new_tokens = read_tree_result(got, rows.tree.max_depth)
        cache.commit(rows.base + 1, path)  # cur stays at `base`; the accepted path follows contiguously
        return path, new_tokens

    def _verify_chain(
        self, cur: int, draft: Draft, cache: KVCache, params: SamplingParams, gen: torch.Generator
    ) -> tuple[list[int], list[int]]:
        """-> (accepted draft indices, appended tokens)."""
        rows = self.rows(cur, draft, cache, as_tree=False)
        logits = self.target(rows.ids, cache)[: rows.n].float()  # [k+1, V]
        return self.accept(rows, logits, draft, cache, params, gen)

    def _verify_tree(
        self, cur: int, draft: Draft, cache: KVCache, params: SamplingParams, gen: torch.Generator
    ) -> tuple[list[int], list[int]]:
        """-> (accepted node indices, appended tokens)."""
        rows = self.rows(cur, draft, cache, as_tree=True)
        logits = self.target(rows.ids, cache, Layout.block(rows.rel_mask, rows.positions))[: rows.n].float()
        return self.accept(rows, logits, draft, cache, params, gen)



def _no_draft() -> Draft:
    return Draft(torch.empty(0, dtype=torch.long), None)  # plain decoding: verify `cur` alone


def _record_round(stats: DecodeStats, draft: Draft, n_accepted: int, cut: bool) -> None:
    """Count one verified draft. When the sequence ended at an accepted draft, the drafts deeper
    than it are not part of the output and are not counted (alpha stays the target's verdict)."""
    n = int(draft.tokens.numel())
    depths = list(range(1, n + 1)) if draft.is_chain else list(compile_tree(tuple(draft.parents)).depths)
    if cut:
        depths = [d for d in depths if d <= n_accepted]
    stats.record_round(len(depths), n_accepted, max(depths))


def _first_eos(tokens: list[int], eos: frozenset[int]) -> int:
    """Length of ``tokens`` up to and including its first EOS (all of it when there is none)."""
    for i, t in enumerate(tokens):
        if t in eos:
            return i + 1
    return len(tokens)


