"""Batched serving on a GPU (issue 28): `autotune serve`'s batch, eager or under ``--compile`` (K/V
slots, one compiled graph per row bucket, CUDA graphs on CUDA), on random weights with a real
tokenizer (the packaged GGUF weights do not travel to a lent GPU machine; the tokenizer files do).

    python tools/gpu_serve_check.py --tokenizer DIR [--compile] [--device cuda] [--dtype bfloat16]
        [--model qwen2.5-coder-1.5b] [--max-batch-rows 32] [--tokens 48] [--json OUT.json]
        [--plain-only --no-control]        # four plain requests: the shortest compiled start-up

On a lent GPU machine (docs/benchmarks.md, "Batched serving on a GPU"): copy the tokenizer files
of a packaged model (``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``,
``config.json`` from ``~/.cache/autotune/models/<model>-*/``) into an ignored folder and carry it.
The four-strategy compiled start-up took over 7 minutes on an H200 (the plain one 147 s): give
``--compile`` a time limit to match. ``--max-batch-rows`` must hold the four requests' rows (24
here), or the batch's step would compile a bucket inside the requests.

The server runs in this process (uvicorn in a thread, HTTP on loopback). The draft is the target
itself, so chains and trees are accepted and verifies are wide even on random weights. Four
requests (plain, a draft chain, a draft tree, prompt lookup), each pinned to its strategy, are sent
one at a time, then all at once (the worker holds the first until the others queue, and drafts at
each strategy's own length): per request, whether its token ids equal its solo answer, where they
first part, and what it drafted. Also: start-up seconds (the compiled buckets' share), the
steps' rows and time by batch size, tokens/s alone and together, and under ``--compile`` the graphs
compiled and CUDA-graph skips counted by torch during the requests (0 and 0: every step replayed a
graph built at start-up). docs/design.md: bf16 on a GPU is not batch-invariant, so this reports
agreement; identity is the fp32 CPU claim.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

STRATEGY_ARGS = {  # name -> Strategy kwargs (the draft is the target itself)
    "chain": dict(draft_length=4, confidence_threshold=0.0),
    "tree": dict(draft_length=3, confidence_threshold=0.0, tree_widths=(2, 2, 1)),
    "lookup": dict(drafter="prompt-lookup", draft_length=6),
}
PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number, with a docstring and tests.",
    "A farmer has 17 sheep and buys 5 more each week. How many sheep does he have after 6 weeks?",
    "Summarise the plot of a short story about a lighthouse keeper who finds a message in a bottle.",
    "def quicksort(xs):\n    \"\"\"Sort xs.\"\"\"\n    if len(xs) <= 1:\n        return xs\n    pivot = xs[0]\n",
]


def _counters() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {"unique_graphs": int(counters["stats"]["unique_graphs"]),
            "cudagraph_skips": int(counters["inductor"]["cudagraph_skips"])}


def build(args: argparse.Namespace, tmp: Path, hooks):
    from dataclasses import replace

    from transformers import AutoTokenizer

    from autotune.serving.server import ServeConfig, build_server
    from autotune.store.records import ResultMetrics
    from autotune.store.resolve import strategy_key
    from autotune.store.storage import open_storage
    from runtime.pipeline import ModelPool
    from search_spaces.strategy import Strategy

    pool = ModelPool(device=args.device, compile=args.compile, random_weights=True)
    target = pool.get(args.model, args.dtype)
    target.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)  # the draft is this same object
    url = f"sqlite:///{tmp / 'store.db'}"
    storage = open_storage(url)
    for name, kw in ({} if args.plain_only else STRATEGY_ARGS).items():
        storage.record(strategy_key(target, args.model, name, args.device), Strategy(**kw),
                       ResultMetrics.from_throughput(10.0))
    ids = {b.key.task: str(b.id) for b in storage.list_best()}
    started = time.perf_counter()
    server = build_server(ServeConfig(model=args.model, draft=None if args.plain_only else args.model, dtype=args.dtype, device=args.device,
                                      compile=args.compile, storage=url, max_batch=4, max_context=512,
                                      max_batch_rows=args.max_batch_rows, request_control=not args.no_control),
                          storage, pool=pool, hooks=hooks,
                          adjust=lambda config: replace(config, load_aware=False))  # each drafts its own length
    return server, storage, ids, time.perf_counter() - started


def chat(url: str, model: str, text: str, strategy: str, tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": tokens,
            "temperature": 0, "autotune": {"strategy": strategy, "return_token_ids": True}}
    started = time.perf_counter()
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    info = r.json()["autotune"]
    info["_seconds"] = time.perf_counter() - started
    return info


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", required=True, help="a folder with the model family's tokenizer files")
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--max-batch-rows", type=int, default=32)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--plain-only", action="store_true",
                   help="no draft, four plain requests (the shortest compiled start-up: plain steps and the buckets)")
    p.add_argument("--no-control", action="store_true", help="serve --no-request-control (fewer start-up timings)")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    import logging

    import uvicorn

    from autotune.serving.server import make_app
    from autotune.serving.worker_config import Hooks

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    report: dict = {"model": args.model, "device": args.device, "dtype": args.dtype, "compile": args.compile,
                    "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None}
    tmp = Path(tempfile.mkdtemp())
    print(f"building the server ({'compiled' if args.compile else 'eager'})", flush=True)
    steps: list[tuple[int, int, float]] = []  # (sequences, rows, seconds since the last step ended)
    last = [time.perf_counter()]

    def on_step(batch):
        now = time.perf_counter()
        steps.append((len(batch), sum(r.member.decoder.last_rows for r in batch), now - last[0]))
        last[0] = now

    gate = threading.Event()
    gate.set()
    server, storage, ids, startup_s = build(args, tmp, Hooks(on_step=on_step, fault=lambda job: gate.wait(60)))
    worker = server.worker
    slots = worker.decoders.slots
    report["startup_s"] = round(startup_s, 1)
    report["slots"] = None if slots is None else {"n": slots.n_slots, "mib_per_slot": slots.bytes_per_slot / 2**20}
    report["step_profile_ms"] = [(r, s, round(t * 1e3, 2)) for r, s, t in worker.figures.step_cost.profile]
    print(json.dumps(report), flush=True)
    uv = uvicorn.Server(uvicorn.Config(make_app(server, 3600.0), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    while not uv.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{uv.servers[0].sockets[0].getsockname()[1]}"
    names = ["plain"] * 4 if args.plain_only else ["plain", "chain", "tree", "lookup"]
    jobs = list(zip(PROMPTS, [ids.get(n, "plain") for n in names]))
    before = _counters()
    print("requests alone", flush=True)
    alone = [chat(url, args.model, text, s, args.tokens) for text, s in jobs]
    alone_s = sum(a["_seconds"] for a in alone)
    gate.clear()
    print("requests together", flush=True)
    started = time.perf_counter()
    with cf.ThreadPoolExecutor(len(jobs)) as ex:
        futures = [ex.submit(chat, url, args.model, text, s, args.tokens) for text, s in jobs]
        deadline = time.monotonic() + 60
        while worker.requests.waiting < len(jobs) - 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        steps.clear()
        last[0] = time.perf_counter()
        gate.set()
        together = [f.result() for f in futures]
    together_s = time.perf_counter() - started
    after = _counters()
    rows = []
    for name, a, b in zip(names, alone, together):
        ta, tb = a["token_ids"], b["token_ids"]
        first = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None if len(ta) == len(tb) else min(len(ta), len(tb)))
        rows.append({"request": name, "equal": ta == tb, "first_difference": first, "tokens": len(tb),
                     "drafted_alone": a.get("drafted"), "accepted_alone": a.get("accepted"),
                     "drafted_batched": b.get("drafted"), "accepted_batched": b.get("accepted")})
    tokens = sum(len(b["token_ids"]) for b in together)
    report.update({
        "requests": rows,
        "alone_tok_s": round(sum(len(a["token_ids"]) for a in alone) / alone_s, 2),
        "together_tok_s": round(tokens / together_s, 2),
        "steps": len(steps), "max_rows": max((r for _, r, _ in steps), default=0),
        # median seconds between consecutive batched steps' ends, by batch size (a step, its
        # drafting and the worker's bookkeeping)
        "step_ms_by_batch": {n: round(1e3 * statistics.median(t for m, _, t in steps if m == n), 2)
                             for n in sorted({m for m, _, _ in steps})},
        "graphs_compiled_during_requests": after["unique_graphs"] - before["unique_graphs"],
        "cudagraph_skips_during_requests": after["cudagraph_skips"] - before["cudagraph_skips"],
        "counters_after": after,
    })
    print(json.dumps(report, indent=1), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    uv.should_exit = True
    thread.join(30)
    storage.close()


if __name__ == "__main__":
    main()
