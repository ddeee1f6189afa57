"""A short, stable name for the kind of machine a strategy was tuned on.

Tuned strategies are stored per hardware (a draft that pays off on one CPU may not on another), so
the fingerprint names what decides the cost of a forward pass: the processor model, the logical
cores, the torch threads and version, and the GPU model when decoding runs on CUDA. It holds no
host names or serial numbers, so teams sharing one database share results across identical machines.
"""
from __future__ import annotations

from runtime.machine import cpu_fingerprint


def hardware_fingerprint(device: str = "cpu") -> str:
    """E.g. ``"Intel(R) Xeon(R) Platinum 8488C x2 t2 torch2.13.0"`` (plus ``" cuda:NVIDIA H100..."``
    when ``device`` is a CUDA device). Deterministic for one machine and thread setting."""
    import torch

    from runtime.errors import RuntimeUserError

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise RuntimeUserError(f"unknown device {device!r}; use cpu, cuda, cuda:N or mps") from None
    parts = [cpu_fingerprint()]
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else 0
        name = torch.cuda.get_device_name(index) if torch.cuda.is_available() else "unavailable"
        parts.append(f"cuda:{name}")
    elif dev.type != "cpu":
        parts.append(dev.type)
    return " ".join(parts)
