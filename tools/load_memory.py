"""Resident memory of loading a model, each precision in a fresh process: the process's resident size
(VmRSS) after loading and one plain step, its peak (VmHWM), each less
that of a bare interpreter with torch, transformers and the project imported, beside the GGUF
file's size, and the seconds until it can step (``ModelPool.get`` and ``served``; caches made).

    python tools/load_memory.py [--model qwen2.5-coder-1.5b] [--precisions gguf,int4,w8a8,float32] [--index]

``--index`` also times finding the file's tensors: ``runtime.gguf_file.read_index`` beside the
``gguf`` package's ``GGUFReader`` (which decodes every metadata value too).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, sys, torch
import transformers, runtime.pipeline, runtime.transformer

def status():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {k: int(fields[k].split()[0]) / 2**20 for k in ("VmRSS", "VmHWM")}  # GiB

import time
model, precision = sys.argv[1], sys.argv[2]
bare = status()
load_s = 0.0
if precision != "-":
    from runtime.pipeline import ModelPool
    pool = ModelPool()
    start = time.perf_counter()
    lm = pool.served(pool.get(model, precision))
    load_s = time.perf_counter() - start
    with torch.inference_mode():
        lm(torch.tensor([1, 2, 3]), lm.new_cache(8))
print(json.dumps({"bare": bare, "loaded": status(), "load_s": load_s}))
"""


def measure(model: str, precision: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, model, precision], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--precisions", default="gguf,int4,w8a8,float32")
    ap.add_argument("--index", action="store_true", help="also time read_index against gguf.GGUFReader")
    args = ap.parse_args()
    from runtime.loading import kept_gguf
    from runtime.models import resolve_model

    path = kept_gguf(resolve_model(args.model), args.model)
    size = path.stat().st_size / 2**30
    print(f"{args.model}: GGUF file {size:.2f} GiB")
    if args.index:
        import time

        import gguf

        from runtime.gguf_file import read_index

        for label, read in (("read_index", read_index), ("gguf.GGUFReader", lambda p: gguf.GGUFReader(str(p), "c"))):
            start = time.perf_counter()
            read(path)
            print(f"{label}: {time.perf_counter() - start:.2f} s")
    print(f"{'precision':>10} {'resident GiB':>13} {'x file':>7} {'peak GiB':>9} {'x file':>7} {'load s':>7}")
    for precision in args.precisions.split(","):
        r = measure(args.model, precision)
        rss = r["loaded"]["VmRSS"] - r["bare"]["VmRSS"]
        peak = r["loaded"]["VmHWM"] - r["bare"]["VmRSS"]
        print(f"{precision:>10} {rss:>13.2f} {rss / size:>7.2f} {peak:>9.2f} {peak / size:>7.2f} {r['load_s']:>7.1f}")


if __name__ == "__main__":
    main()
