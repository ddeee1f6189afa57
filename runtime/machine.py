"""What this machine is (the processor's model name), for keys of things measured on it."""
from __future__ import annotations

import platform
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


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
