"""How much memory a server's requests and its prefix cache get: ``--max-batch``, the per-request
context and the prefix cache's budget, sized from the memory free once the models are loaded.

- The prefix cache takes ``--prefix-cache-gib`` (default: ``PREFIX_CACHE_GIB``, or
  ``PREFIX_SHARE`` of the free memory where that is less; 0: no prefix cache).
- Of the rest, the requests' KV caches may take ``KV_SHARE``.
- Without ``--max-context``, the context is what fits ``--max-batch`` requests (default
  ``MAX_BATCH``) in that room, at most the model's, in whole ``CONTEXT_STEP`` s (llama-server splits its
  ``-c`` across its slots the same way). With it, ``--max-batch`` is what fits, at most ``MAX_BATCH``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autotune.errors import SettingError

MAX_BATCH = 16  # the default --max-batch where memory allows it
KV_SHARE = 0.8  # of the memory free after loading (less the prefix cache), what the requests' KV caches may take
PREFIX_CACHE_GIB = 2.0  # the prefix cache's default budget ...
PREFIX_SHARE = 0.25  # ... or this share of the free memory where that is less
CONTEXT_STEP = 256  # a context sized to fit is a whole number of these
MIN_CONTEXT = 512  # a context sized to fit below this is refused (lower --max-batch or the prefix cache's budget)
GIB = 2**30


@dataclass(frozen=True)
class Sizing:
    """What a server decodes with: ``max_batch`` requests of up to ``context`` tokens each, and a
    prefix cache of ``prefix_bytes`` (0: none); ``how`` says where the figures came from."""

    max_batch: int
    context: int
    prefix_bytes: int
    how: str
    prefix_off: str = "--no-prefix-cache"  # why there is no prefix cache, where there is none

    def describe(self) -> str:
        """The ready line's words."""
        cache = (f"prefix cache {self.prefix_bytes / GIB:.1f} GiB" if self.prefix_bytes
                 else f"no prefix cache ({self.prefix_off})")
        return f"{self.max_batch} x {self.context}-token context ({self.how}), {cache}"


def kv_bytes_per_slot(config: Any, context: int, element_bytes: int = 4) -> int:
    """KV cache bytes one request of ``context`` tokens holds (keys and values, every layer), its
    caches in the model's float dtype (``element_bytes``: 4 for float32)."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * element_bytes * context


def batch_size(asked: int | None, slot_bytes: int, context: int, free: int | None) -> int:
    """``--max-batch``: as asked when its caches fit in ``free`` bytes (else a start-up error naming
    the sizes), or what fits, at most ``MAX_BATCH``."""
    if asked is not None:
        if free is not None and asked * slot_bytes > free:
            raise SettingError(
                f"--max-batch {asked} x a {context}-token context needs {asked * slot_bytes / GIB:.1f} GiB of KV cache "
                f"({slot_bytes / GIB:.2f} GiB per request) and {free / GIB:.1f} GiB is free; lower --max-batch or "
                "--max-context")
        return asked
    if free is None:
        return MAX_BATCH
    return max(1, min(MAX_BATCH, int(free * KV_SHARE // slot_bytes)))


def prefix_budget(asked_gib: float | None, free: int | None) -> int:
    """The prefix cache's bytes: as asked (0: none; more than is free: a start-up error), else the
    default."""
    if asked_gib is not None:
        want = int(asked_gib * GIB)
        if free is not None and want > free:
            raise SettingError(f"--prefix-cache-gib {asked_gib:g} is more than the {free / GIB:.1f} GiB free after "
                               "loading the models; lower it, or turn the cache off with --no-prefix-cache")
        return want
    default = int(PREFIX_CACHE_GIB * GIB)
    return default if free is None else min(default, int(free * PREFIX_SHARE))


def size(asked_batch: int | None, asked_context: int | None, asked_prefix_gib: float | None, model_context: int,
         token_bytes: int, free: int | None) -> Sizing:
    """The server's batch, context and prefix cache (see the module's rules); ``token_bytes``: one
    token's K/V in every layer; ``free``: bytes free after loading (None: unknown)."""
    prefix = prefix_budget(asked_prefix_gib, free)
    room = None if free is None else max(free - prefix, 0)
    if asked_context is not None:
        context = min(asked_context, model_context)
        return Sizing(batch_size(asked_batch, token_bytes * context, context, room), context, prefix, "--max-context")
    batch = asked_batch if asked_batch is not None else MAX_BATCH
    if room is None:
        return Sizing(batch, model_context, prefix, "the model's")
    fits = int(room * KV_SHARE) // (batch * token_bytes)
    if fits >= model_context:
        return Sizing(batch, model_context, prefix, "the model's")
    context = fits // CONTEXT_STEP * CONTEXT_STEP
    if context < MIN_CONTEXT:
        raise SettingError(
            f"{batch} requests of at least {MIN_CONTEXT} tokens need {batch * MIN_CONTEXT * token_bytes / GIB:.1f} GiB "
            f"of KV cache and {room * KV_SHARE / GIB:.1f} GiB is left for it beside a {prefix / GIB:.1f} GiB prefix "
            "cache; lower --max-batch or --prefix-cache-gib")
    return Sizing(batch, context, prefix, f"sized to fit {room * KV_SHARE / GIB:.1f} GiB")
