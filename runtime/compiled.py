"""Compiled decode steps: ``torch.compile(fullgraph=True, dynamic=False)`` over a model's static-shape
step (``CausalLM._step``), one graph per (layer plan, width, mask shape).

Every forward after the prefill has static shapes (decode ``T = 1``, verify ``T = W``, a draft
tree's frontier per depth, a catch-up padded to the draft depth + 1), so a decode compiles a handful of graphs
once and replays them. On CUDA the mode is ``reduce-overhead`` (CUDA graphs). ``fullgraph=True``
makes a graph break an error instead of a silent partial compile, and the number of graphs is
bounded: past ``MAX_COMPILED_STEPS`` distinct steps every compiled graph is dropped
(``torch._dynamo.reset``) and recompiled on demand, so a tuner that tries hundreds of plans stays
within memory; dynamo is told to fail rather than fall back to eager when it would exceed its own
limit.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from contextvars import ContextVar
from typing import Any

import torch

MAX_COMPILED_STEPS = 40  # distinct (plan, shape) graphs kept, over every compiled model in the process
# (a compiled server: its decode and verify steps plus a batched step per row bucket, runtime.slots)

CAPACITY_BUCKET = 256  # compiled decodes size their caches in these steps: one graph per bucket, not per prompt

_seen: OrderedDict[Hashable, None] = OrderedDict()
NEW_STEPS = [0]  # distinct steps seen so far in this process (each one a compilation): bench reports
# how many happened inside measured runs


def cuda_graphs(device: torch.device) -> bool:
    """Whether compiled steps on ``device`` run as CUDA graphs (launch-bound decode steps)."""
    return device.type == "cuda"


def compile_mode(device: torch.device) -> str:
    """CUDA graphs on CUDA, inductor's default elsewhere."""
    return "reduce-overhead" if cuda_graphs(device) else "default"


RECOMPILE_LIMIT = 2 * MAX_COMPILED_STEPS  # dynamo's graphs per code object (one ``_step`` serves every shape)
# whether ``allow_recompiles`` ran in this context: torch keeps its config overrides in context
# variables, so this flag has exactly their scope (a thread, or a copied context)
_LIMITS_RAISED: ContextVar[bool] = ContextVar("autotune_recompile_limits_raised", default=False)


def allow_recompiles() -> None:
    """Raise dynamo's recompile limits, and fail rather than run eager past them, **in the calling
    thread**: torch keeps a config set in code as a per-thread override (torch 2.13), so a limit
    raised where a server compiled its steps at start-up did not hold in its decode thread, where
    the ninth graph of ``_step`` (a new strategy's or shape's) failed the request (found by
    ``tools/gpu_serve_check.py --compile``). Called wherever compiled steps are built or run."""
    if _LIMITS_RAISED.get():  # every compiled step passes here: one context-variable read
        return
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, RECOMPILE_LIMIT)
    cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 8 * MAX_COMPILED_STEPS)
    cfg.fail_on_recompile_limit_hit = True  # never run eager silently
    _LIMITS_RAISED.set(True)


def compile_step(fn: Callable[..., torch.Tensor], device: torch.device) -> Callable[..., torch.Tensor]:
    """``fn`` compiled whole (no graph breaks), static shapes."""
    allow_recompiles()
    return torch.compile(fn, fullgraph=True, dynamic=False, mode=compile_mode(device))


def bucketed(capacity: int, step: int = CAPACITY_BUCKET) -> int:
    """``capacity`` rounded up to a multiple of ``step``."""
    return -(-capacity // step) * step


def run_step(step: Callable[..., torch.Tensor], device: torch.device, *args: Any) -> torch.Tensor:
    """Call a compiled step. Under CUDA graphs each call is a new step whose output buffer the next
    replay overwrites, so the logits are copied out. The recompile limits are made to hold in the
    calling thread first (``allow_recompiles``)."""
    allow_recompiles()
    if not cuda_graphs(device):
        return step(*args)
    torch.compiler.cudagraph_mark_step_begin()
    return step(*args).clone()


def note_step(key: Hashable) -> None:
    """Count the graph ``key`` names; beyond the bound, drop every compiled graph (they recompile
    when next used)."""
    if key in _seen:
        _seen.move_to_end(key)
        return
    if len(_seen) >= MAX_COMPILED_STEPS:
        torch._dynamo.reset()
        _seen.clear()
    _seen[key] = None
    NEW_STEPS[0] += 1


def step_key(model: Any, tokens: torch.Tensor, rel_mask: torch.Tensor | None, cp: Any, *flags: Any) -> Hashable:
    """What a compiled step's graph depends on besides tensor values."""
    rel = None if rel_mask is None else tuple(rel_mask.shape)
    return (id(model), tokens.shape[0], rel, id(cp)) + flags
