"""How close a many-row step at ``--precision gguf`` comes to this machine's int8 dot-product peak,
and the floor that peak puts under "16 rows cost at most N x one row".

    python tools/int8_roof.py [--model qwen2.5-coder-1.5b] [--rows 16]

1. The peak: a small C loop of sixteen independent 256-bit ``dpbusd`` chains (AVX-512 VNNI; where the
   CPU has none, ``maddubs`` + ``madd`` + ``add``, as the AVX2 kernels form the same sums), built here
   with the system compiler for this CPU and run on 1 thread and on torch's thread count: 32 int8
   multiply-adds a chain step.
2. The step: the model's forward of ``--rows`` rows after 256 cached tokens, and of one row, at gguf
   (``autotune.measure.profile.forward_step``), best of 5 after a warm-up.
3. The multiply-adds a row costs (every projection and the head: the weights' element count), the
   rate the many-row step reached (a share of the peak), and the floor: ``rows x MACs a row / peak``
   against the one-row step's time.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

PEAK_C = r"""
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
#include <omp.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(void) {
    const long n = 40000000;
    int sink = 0;
    double start = now();
#pragma omp parallel reduction(+ : sink)
    {
        __m256i a[16];
        const __m256i u = _mm256_set1_epi8(3), s = _mm256_set1_epi8(5);
        for (int i = 0; i < 16; ++i) a[i] = _mm256_set1_epi32(i);
        for (long i = 0; i < n; ++i) {
#pragma GCC unroll 16
            for (int j = 0; j < 16; ++j) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
                a[j] = _mm256_dpbusd_epi32(a[j], u, s);
#else
                a[j] = _mm256_add_epi32(a[j], _mm256_madd_epi16(_mm256_set1_epi16(1), _mm256_maddubs_epi16(a[j], s)));
#endif
            }
#pragma GCC unroll 16
            for (int j = 0; j < 16; ++j) __asm__ volatile("" : "+x"(a[j]));  // sixteen registers, no memory
        }
        for (int i = 0; i < 16; ++i) sink += _mm256_extract_epi32(a[i], 0);
    }
    double seconds = now() - start;
    printf("%.6e %d\n", 32.0 * 16 * n * omp_get_max_threads() / seconds, sink & 1);
    return 0;
}
"""


def peak_macs(threads: int) -> float:
    """int8 multiply-adds a second on ``threads`` threads (best of 3)."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise SystemExit("int8_roof: no C compiler (gcc) on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "peak.c", Path(tmp) / "peak"
        src.write_text(PEAK_C)
        subprocess.run([compiler, "-O2", "-march=native", "-fopenmp", str(src), "-o", str(exe)], check=True)
        runs = [subprocess.run([str(exe)], check=True, capture_output=True, text=True,
                               env={"OMP_NUM_THREADS": str(threads)}).stdout.split()[0] for _ in range(3)]
    return max(float(r) for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--rows", type=int, default=16)
    args = parser.parse_args()
    from autotune.measure.profile import forward_step, served_lm
    from autotune.timing import time_calls
    from runtime.pipeline import ModelPool

    threads = torch.get_num_threads()
    one, many = peak_macs(1), peak_macs(threads)
    lm = served_lm(ModelPool().get(args.model, "gguf"))
    linears = [lin for layer in lm.linears for lin in layer.values()] + [lm.head]
    macs = sum(lin.source.rows_total * lin.source.k for lin in linears)
    row = time_calls(forward_step(lm, 256, 1, None, False), repeats=5).best * 1e3
    rows = time_calls(forward_step(lm, 256, args.rows, None, False), repeats=5).best * 1e3
    floor = args.rows * macs / many * 1e3
    print(f"| peak, 1 thread | peak, {threads} threads | MACs a row | 1 row ms | {args.rows} rows ms "
          f"| x one row | {args.rows}-row rate / peak | floor at the peak, ms | floor / 1 row |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| {one / 1e9:.0f} G/s | {many / 1e9:.0f} G/s | {macs / 1e9:.2f} G | {row:.1f} | {rows:.1f} "
          f"| {rows / row:.2f} | {args.rows * macs / (rows / 1e3) / many:.0%} | {floor:.0f} | {floor / row:.2f} |")


if __name__ == "__main__":
    main()
