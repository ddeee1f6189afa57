"""Whether ``auto`` pays before its first token: the same short prompts sent in interleaved modes.

    python tools/first_token_probe.py --url http://127.0.0.1:8079 \
        --pattern plain,plain,auto,auto,plain --repeats 2
    python tools/first_token_probe.py --assign

1. Against a running ``autotune serve`` (``--url``): the ``mixed`` stream's first three translation
   and first three NQ-open prompts, each sent once per slot of ``--pattern`` (a mode a slot, in that
   order), ``--repeats`` times over. It prints each slot's mean time to first token, latency and
   client wall time. A slot's position, not its mode, is what the pattern varies. Any price ``auto``
   pays before the first token shows as its slots coming later than plain's.
2. ``--assign``, with no server: what assigning a pending cluster costs
   (``PendingClusters.assign``). The unknown requests of the ``mixed`` stream (``--block 3
   --blocks-per-task 2``, every category but HumanEval and GSM8K) are assigned and added in stream
   order. It prints each assignment's time and the texts pending then.
"""
from __future__ import annotations

import argparse
import statistics
import time

from studies.stream import mixed_stream

SHORT = ("translation", "nq-open")
ROUTED = ("humaneval", "gsm8k")  # studied tasks: routed, never pending


def probe(url: str, pattern: list[str], repeats: int, max_tokens: int) -> None:
    from autotune.measure.replay import ReplayClient, ReplaySettings

    stream = mixed_stream(block=3, blocks_per_task=2)
    requests = [r for c in SHORT for r in [q for q in stream if q.category == c][:3]]
    slots: dict[int, list[tuple[float, float, float]]] = {i: [] for i in range(len(pattern))}
    with ReplayClient(ReplaySettings(url=url, max_tokens=max_tokens)) as client:
        model = client.model_name()
        for _ in range(repeats):
            for request in requests:
                for i, mode in enumerate(pattern):
                    started = time.perf_counter()
                    record = client.chat(model, request, mode)
                    slots[i].append((record.ttft_s, record.latency_s, time.perf_counter() - started))
    for i, mode in enumerate(pattern):
        ttft, latency, wall = (statistics.mean(x[k] for x in slots[i]) for k in range(3))
        print(f"slot {i} {mode:8s} first token {ttft:.3f} s, latency {latency:.3f} s, wall {wall:.3f} s "
              f"({len(slots[i])} sends)")


def assign_cost() -> None:
    from autotune.serving.adaptive.clusters import PendingClusters
    from studies.prompt import routing_text

    pending = PendingClusters()
    for request in mixed_stream(block=3, blocks_per_task=2):
        if request.category in ROUTED:
            continue
        text = routing_text(request.prompt)
        started = time.perf_counter()
        cid = pending.assign(text)
        spent = time.perf_counter() - started
        pending.add(cid, text)
        print(f"request {request.index:2d} {request.category:12s} {spent * 1000:5.1f} ms, "
              f"{sum(pending.sizes().values())} texts pending")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="a running autotune serve (the probe)")
    parser.add_argument("--pattern", default="plain,plain,auto,auto,plain", help="a mode per slot")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--assign", action="store_true", help="time the pending clusters' assignment instead")
    args = parser.parse_args()
    if args.assign:
        assign_cost()
    elif args.url:
        probe(args.url, [m.strip() for m in args.pattern.split(",") if m.strip()], args.repeats, args.max_tokens)
    else:
        parser.error("pass --url of a running autotune serve, or --assign")


if __name__ == "__main__":
    main()
