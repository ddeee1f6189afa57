"""``--precision auto`` on the CPU: int4, w8a8 or gguf, whichever this machine's kernels run faster.

All are exact relative to themselves (row-invariant kernels: ``runtime.quant``, ``runtime.gguf_blocks``),
so each one's speculative output equals its own plain output. gguf is a candidate only where ggml's
kernels are built for this CPU (``make kernels``); elsewhere it is timed as unavailable and never
chosen. Which is faster depends on the processor (docs/precision.md has the measurements), so the
choice is measured, once per machine: every candidate runs the same synthetic projections (the
1.5B's MLP shape, enough of them to stream from memory, not from cache) at one row (a plain step)
and at ``VERIFY_ROWS`` rows (a speculative round's verify), and the smallest sum wins. The result
is kept in ``~/.cache/autotune/auto-precision.json`` (``$AUTOTUNE_CACHE_DIR``) per processor, core
and thread count and torch version, so only the first command on a machine pays the probe (a few
seconds). ``$AUTOTUNE_AUTO_PRECISION`` pins the choice (reproducible runs, tests).
"""
from __future__ import annotations

import json
import os
import time

import torch

from runtime.errors import RuntimeUserError
from runtime.machine import cache_root, cpu_fingerprint

CANDIDATES = ("int4", "w8a8", "gguf")
PIN_ENV = "AUTOTUNE_AUTO_PRECISION"
CACHE_FILE = "auto-precision.json"
VERIFY_ROWS = 8  # a speculative round's verify: a chain of 7 or a lookup copy of 7
PROBE_SHAPE = (8960, 1536)  # the 1.5B's MLP down / up shape
PROBE_MATRICES = 8  # 55 MB at int4, 110 MB at w8a8: beyond a 2-core machine's caches
PROBE_REPEATS = 5


def probe() -> dict[str, float]:
    """Seconds each candidate takes over the probe's matrices at 1 and ``VERIFY_ROWS`` rows (summed,
    best of ``PROBE_REPEATS``)."""
    from runtime.linear import BACKEND_AVAILABLE, make_linear

    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(*PROBE_SHAPE, generator=gen) * 0.02 for _ in range(PROBE_MATRICES)]
    inputs = [torch.randn(rows, PROBE_SHAPE[1], generator=gen) for rows in (1, VERIFY_ROWS)]
    seconds = {}
    with torch.inference_mode():
        for name in CANDIDATES:
            if not BACKEND_AVAILABLE[name]():  # this torch build lacks its kernel: never chosen
                seconds[name] = float("inf")
                continue
            linears = [make_linear(name, w, None) for w in weights]
            total = 0.0
            for x in inputs:
                for lin in linears:  # warm: first-call allocations
                    lin(x)
                best = float("inf")
                for _ in range(PROBE_REPEATS):
                    start = time.perf_counter()
                    for lin in linears:
                        lin(x)
                    best = min(best, time.perf_counter() - start)
                total += best
            seconds[name] = total
            del linears
    return seconds


def _probed_all(hit: dict) -> bool:
    """Whether a kept answer timed every candidate that is available now (one kept before a
    candidate existed, or before its kernels were built, is probed again)."""
    from runtime.linear import BACKEND_AVAILABLE

    timed = hit.get("seconds")
    if not isinstance(timed, dict):
        return False
    return all(name in timed and (timed[name] is not None or not BACKEND_AVAILABLE[name]()) for name in CANDIDATES)


def cpu_auto_precision() -> str:
    """The precision ``auto`` means on this CPU: pinned by ``$AUTOTUNE_AUTO_PRECISION``, else this
    machine's kept probe result, else a new probe (kept)."""
    pinned = os.environ.get(PIN_ENV, "").strip()
    if pinned:
        if pinned not in CANDIDATES:
            raise RuntimeUserError(f"${PIN_ENV}={pinned!r} is not a CPU auto precision; use one of {', '.join(CANDIDATES)}")
        return pinned
    path, key = cache_root() / CACHE_FILE, cpu_fingerprint()
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):
        kept = {}
    hit = kept.get(key) if isinstance(kept, dict) else None
    if isinstance(hit, dict) and hit.get("precision") in CANDIDATES and _probed_all(hit):
        return hit["precision"]
    seconds = probe()
    choice = min(CANDIDATES, key=lambda name: seconds.get(name, float("inf")))
    kept = kept if isinstance(kept, dict) else {}
    kept[key] = {"precision": choice,
                 "seconds": {k: (round(v, 6) if v != float("inf") else None) for k, v in seconds.items()},
                 "verify_rows": VERIFY_ROWS}
    try:  # written whole (a rename), so a reader never sees half a file
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(kept, indent=1))
        tmp.replace(path)
    except OSError:  # an unwritable cache: this process keeps its answer, the next one probes again
        pass
    return choice


def explain(precision: str, asked: str = "auto") -> str:
    """Why a model runs at ``precision`` (``asked``: what the user passed), in words: ``auto``'s
    measured choice on this CPU (each candidate's probe time, what was unavailable), its pin, or
    the user's explicit choice."""
    if asked != "auto":
        return f"{precision} (--precision {asked})"
    pinned = os.environ.get(PIN_ENV, "").strip()
    if pinned:
        return f"{precision} (${PIN_ENV}={pinned})"
    try:
        kept = json.loads((cache_root() / CACHE_FILE).read_text()).get(cpu_fingerprint())
    except (OSError, ValueError, AttributeError):
        kept = None
    if not isinstance(kept, dict) or kept.get("precision") != precision:
        return f"{precision} (auto)"
    timed = kept.get("seconds", {})
    parts = [f"{name} {timed[name] * 1e3:.0f} ms" if timed.get(name) is not None else f"{name} unavailable"
             for name in CANDIDATES if name in timed]
    return (f"{precision} (auto on this CPU: a plain step plus an {kept.get('verify_rows', VERIFY_ROWS)}-row verify "
            f"of the probe's projections took {', '.join(parts)})")
