"""Whether the extension's AVX-512 VNNI paths give the very bits of its AVX2 paths, on a CPU with VNNI.

    python tools/vnni_paths.py

The built extension (``make kernels``: VNNI on this CPU) and a second build of the same source with
``-mno-avx512vnni`` (its AVX2 branches: ``maddubs`` + ``madd``), linked against the same ggml
libraries, in a temporary folder, run the same matmuls: repacked Q4_K (``repacked.h``) and the Q5_0 /
Q8_0 rows kernels (``lane_sums``), at 1, 4 and 13 activation rows. Both form exact integer sums, so
every output must be identical; the table says so per case.
"""
from __future__ import annotations

import tempfile

import torch

Q4_K, Q5_0, Q8_0 = 12, 6, 8


def avx2_build(folder: str):
    from torch.utils.cpp_extension import load as load_extension

    from runtime.kernels import SOURCE, extension_cflags, kernel_dir
    from runtime.kernels.build import _library, source_tree

    build = kernel_dir() / "ggml-build"
    tree = source_tree(kernel_dir() / "build.log")
    libs = [str(_library(build, "ggml-cpu")), str(_library(build, "ggml-base"))]
    return load_extension(name="autotune_ggml_avx2", sources=[str(SOURCE)], build_directory=folder,
                          extra_include_paths=[str(tree / "ggml" / "include")],
                          extra_cflags=[*extension_cflags(), "-mno-avx512vnni"],
                          extra_ldflags=[*libs, "-fopenmp", "-lpthread"])


def main() -> None:
    from runtime.kernels import load

    vnni = load()
    if "avx512_vnni" not in vnni.cpu_features():
        raise SystemExit("vnni_paths: this CPU has no AVX-512 VNNI; its build already runs the AVX2 paths")
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        avx2 = avx2_build(folder)
        print("| weights | rows | identical |\n|---|---|---|")
        for kind, name, n, k in ((Q4_K, "Q4_K repacked", 1536, 8960), (Q4_K, "Q4_K repacked", 4096, 1536),
                                 (Q5_0, "Q5_0", 896, 896), (Q8_0, "Q8_0", 512, 896)):
            w = vnni.quantize(torch.randn(n, k), kind)
            packed = vnni.repack(w, kind, k) if kind == Q4_K else None
            weights, types = ([packed], [vnni.repacked_type(kind)]) if packed is not None else ([w], [kind])
            for rows in (1, 4, 13):
                x = torch.randn(rows, k)
                same = torch.equal(vnni.matmul(x, weights, types), avx2.matmul(x, weights, types))
                print(f"| {name} {n}x{k} | {rows} | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
