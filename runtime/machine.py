"""What this machine is (for keys of things measured on it) and where it keeps what it caches."""
from __future__ import annotations

import os
import platform
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


def cache_root() -> Path:
    """Where dequantised weights, packed copies and per-machine measurements are cached
    (``$AUTOTUNE_CACHE_DIR``, default ``~/.cache/autotune``; never the repository)."""
    return Path(os.environ.get("AUTOTUNE_CACHE_DIR", Path.home() / ".cache" / "autotune"))


def available_memory() -> int | None:
    """Bytes the kernel says can be allocated now (``MemAvailable``), or None where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def cpu_model_name() -> str:
    """The processor's model name (``/proc/cpuinfo`` on Linux, else what ``platform`` knows)."""
    try:
        for line in CPUINFO.read_text(errors="replace").splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")) and ":" in line:
                name = line.split(":", 1)[1].strip()
                if name:
                    return " ".join(name.split())
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown-cpu"


def cpu_fingerprint() -> str:
    """What decides the cost of CPU arithmetic here: the processor model, the logical cores, the
    torch threads and version, e.g. ``"AMD EPYC x2 t2 torch2.13.0+cpu"``."""
    import torch

    return f"{cpu_model_name()} x{os.cpu_count() or 0} t{torch.get_num_threads()} torch{torch.__version__}"
