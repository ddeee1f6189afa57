"""K/V rows of earlier sequences, handed to later ones that start with the same tokens (prefix caching
across requests, as llama-server's prompt cache, vLLM's automatic prefix caching and SGLang's
RadixAttention do).

Rows are kept in blocks in one trie per model: a block's key is its own tokens under its parent
block, so a match is exact (no hash can collide). The least recently used leaf block goes first
when the byte budget is full.

**Exact by construction**: a row is only reused where it is bit-identical to the row the new
sequence's own prefill would compute, so a response never depends on what was cached.

- A model whose rows are reusable (``CausalLM.rows_reusable``: row-invariant projections and
  attention, the prompt's included) computes a row the same however it was computed: any committed
  row may be kept (a prompt's, and the answer's after it: a chat's next turn reuses both), in
  blocks of ``ROW_BLOCK`` tokens.
- Any other model (float32 on dense GEMMs, int4/int8 with bf16 prefill copies): only the rows of
  whole prefill chunks are kept, reused in whole chunks: the later prompt then runs the very
  forwards (same tokens, same shapes, same earlier rows) its own prefill would have run.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from runtime.kv_cache import KVCache

ROW_BLOCK = 16  # tokens per block on a model whose rows are reusable


@dataclass(eq=False)
class _Block:
    parent: _Block | None
    tokens: tuple[int, ...]
    keys: torch.Tensor | None  # [L, Hkv, n, D] (None: the root)
    values: torch.Tensor | None
    children: dict[tuple[int, ...], _Block] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        if self.keys is None or self.values is None:
            return 0
        return self.keys.nbytes + self.values.nbytes


@dataclass(frozen=True)
class PrefixStats:
    """What the cache holds and has done (``/health`` and ``/metrics``)."""

    budget_bytes: int
    used_bytes: int
    blocks: int
    lookups: int  # sequences that asked for rows
    hits: int  # ... and got some
    tokens_looked_up: int  # their prompt tokens (the ones that could have been reused)
    tokens_reused: int
    evictions: int  # blocks dropped for room

    @property
    def hit_rate(self) -> float:
        """Of the prompt tokens that could have been reused, the share that was."""
        return self.tokens_reused / self.tokens_looked_up if self.tokens_looked_up else 0.0


class _Trie:
    """One model's blocks: ``granularity`` tokens each (a row block, or a prefill chunk)."""

    def __init__(self, model: Any, granularity: int) -> None:
        self.model = model  # held: its id never names another model while this trie lives
        self.granularity = granularity
        self.root = _Block(None, (), None, None)


class PrefixCache:
    """Blocks of K/V rows keyed by token prefix, per model, within ``budget_bytes`` (LRU, leaf blocks
    first). Thread-safe; a server's decode thread writes and reads it, ``/health`` reads ``stats``."""

    def __init__(self, budget_bytes: int, row_block: int = ROW_BLOCK) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"a prefix cache needs a positive budget, got {budget_bytes} bytes")
        if row_block <= 0:
            raise ValueError(f"row_block must be positive, got {row_block}")
        self.budget_bytes, self.row_block = budget_bytes, row_block
        self._tries: dict[tuple[int, str, int], _Trie] = {}
        self._lru: OrderedDict[_Block, _Trie] = OrderedDict()  # every non-root block, least recent first
        self._used = 0
        self._lookups = self._hits = self._looked_up = self._reused = self._evictions = 0
        self._lock = threading.Lock()

    def granularity(self, lm: Any, chunk: int) -> int:
        """Tokens per block for ``lm`` (whose prompts are prefilled ``chunk`` tokens a forward)."""
        return self.row_block if lm.rows_reusable else chunk

    def _trie(self, lm: Any, chunk: int) -> _Trie:
        granularity = self.granularity(lm, chunk)
        key = (id(lm.hf_model), lm.backend, granularity)
        trie = self._tries.get(key)
        if trie is None:
            trie = self._tries[key] = _Trie(lm.hf_model, granularity)
        return trie

    def reuse(self, lm: Any, tokens: list[int], cache: KVCache, chunk: int, limit: int, counted: bool = True) -> int:
        """Copy the longest cached run of ``tokens``' leading rows, at most ``limit``, into ``cache``
        where it is longer than the rows ``cache`` holds (which must be ``tokens``' own exact rows):
        its length then says how many rows it holds -> rows copied from the cache. ``counted``: the
        statistics count the lookup (a target's; a drafting model's are not counted)."""
        with self._lock:
            trie = self._trie(lm, chunk)
            g = trie.granularity
            path: list[_Block] = []
            node = trie.root
            while (len(path) + 1) * g <= limit:
                child = node.children.get(tuple(tokens[len(path) * g : (len(path) + 1) * g]))
                if child is None:
                    break
                path.append(child)
                node = child
            for block in path:  # the path's blocks are the most recently used now, the leaf last
                self._lru.move_to_end(block)
            held = cache.length
            n = len(path) * g
            gained = max(n - held, 0)
            if counted:
                self._lookups += 1
                self._looked_up += max(limit, 0)
                self._hits += gained > 0
                self._reused += gained
            if not gained:
                return 0
            for i, block in enumerate(path):
                if (i + 1) * g <= held:
                    continue
                assert block.keys is not None and block.values is not None
                cache.all_keys[:, :, i * g : (i + 1) * g] = block.keys
                cache.all_values[:, :, i * g : (i + 1) * g] = block.values
            cache.length = n
            return gained

    def offer(self, lm: Any, tokens: list[int], cache: KVCache, rows: int, chunk: int) -> int:
        """Keep the first ``rows`` rows of ``cache`` (the K/V of ``tokens[:rows]``, each as the model
        computes it: committed, through every layer) in whole blocks -> blocks added. On a model whose
        rows are not reusable, offer only what whole prefill chunks of ``chunk`` tokens wrote."""
        rows = min(rows, len(tokens), cache.length)
        added = 0
        with self._lock:
            trie = self._trie(lm, chunk)
            g = trie.granularity
            node = trie.root
            for i in range(rows // g):
                key = tuple(tokens[i * g : (i + 1) * g])
                child = node.children.get(key)
                if child is None:
                    keys = cache.all_keys[:, :, i * g : (i + 1) * g].clone()
                    values = cache.all_values[:, :, i * g : (i + 1) * g].clone()
                    if keys.nbytes + values.nbytes > self.budget_bytes:
                        break
                    child = node.children[key] = _Block(node, key, keys, values)
                    self._used += child.nbytes
                    added += 1
                self._lru[child] = trie
                self._lru.move_to_end(child)
                node = child
            self._evict(protect=node)
        return added

    def _evict(self, protect: _Block) -> None:
        """Drop least recently used leaf blocks until the budget holds (never ``protect``'s path)."""
        keep = set()
        node: _Block | None = protect
        while node is not None:
            keep.add(node)
            node = node.parent
        while self._used > self.budget_bytes:
            victim = next((b for b in self._lru if not b.children and b not in keep), None)
            if victim is None:
                victim = next((b for b in self._lru if not b.children), None)
            if victim is None:
                return
            self._drop(victim)

    def _drop(self, block: _Block) -> None:
        assert block.parent is not None
        del block.parent.children[block.tokens]
        del self._lru[block]
        self._used -= block.nbytes
        self._evictions += 1

    def clear(self) -> None:
        with self._lock:
            self._tries.clear()
            self._lru.clear()
            self._used = 0

    @property
    def stats(self) -> PrefixStats:
        with self._lock:
            return PrefixStats(self.budget_bytes, self._used, len(self._lru), self._lookups, self._hits,
                               self._looked_up, self._reused, self._evictions)
