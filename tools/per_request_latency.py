"""The first N requests of a load test's 1-client point on the ``mixed`` stream, sent one at a time to
each server after one unmeasured warm-up request (the stream's last, an NQ-open question that opens
like none of them), with each request's latency and time to first token.

    python tools/per_request_latency.py 8 auto=ours:auto@http://127.0.0.1:8061 plain=ours:plain@http://127.0.0.1:8061
    python tools/per_request_latency.py 8 llama=http://127.0.0.1:8071

``LABEL=ours:MODE@URL`` is our ``serve`` (its prefix cache reset before the warm-up and again before
the requests; the ``autotune`` figures come back: route, strategy, drafted, accepted);
``LABEL=URL`` is any OpenAI server (llama-server: streamed, timed on the client's side). Prints one
JSON line per request and a total per server. Used on docs/log/26-neutral-warm-up.md.
"""
from __future__ import annotations

import json
import sys
import time

from autotune.measure.loadtest import first_requests, interleaved
from autotune.measure.openai_client import read_stream, request_body
from autotune.measure.replay import ReplayClient, ReplaySettings, _httpx
from studies.stream import mixed_stream

MAX_TOKENS = 96


def streamed(url: str, model: str, request) -> dict:
    """One streamed request on a fresh connection (on one kept-alive connection llama-server dropped
    the request after a streamed one, in this tool's first runs)."""
    with _httpx().Client(base_url=url, timeout=900) as http:
        sent = time.perf_counter()
        with http.stream("POST", "/v1/chat/completions", json=request_body(model, request, MAX_TOKENS)) as resp:
            if resp.status_code != 200:
                raise SystemExit(f"{url}: HTTP {resp.status_code}: {resp.read()[:200]!r}")
            rec = read_stream(resp.iter_lines(), sent, f"{url} {request.prompt.id}")
        end = time.perf_counter()
    return dict(prompt=rec.prompt_tokens, tokens=rec.completion_tokens, ttft=round(rec.ttft_s, 2),
                latency=round(end - sent, 2))


def ours(url: str, mode: str, requests, warm) -> list[dict]:
    rows = []
    with ReplayClient(ReplaySettings(url=url, modes=(mode,))) as client:
        model = client.model_name()
        client.reset_cache()
        client.chat(model, warm, mode)
        client.reset_cache()
        for r in requests:
            t0 = time.perf_counter()
            rec = client.chat(model, r, mode)
            rows.append(dict(tokens=rec.completion_tokens, ttft=round(rec.ttft_s, 2),
                             latency=round(time.perf_counter() - t0, 2), route=rec.route, strategy=rec.strategy,
                             drafted=rec.drafted, accepted=rec.accepted, start=rec.control_start,
                             final=rec.control_final))
    return rows


def peer(url: str, requests, warm) -> list[dict]:
    with _httpx().Client(base_url=url, timeout=60) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
    streamed(url, model, warm)
    return [streamed(url, model, r) for r in requests]


def main(argv: list[str]) -> None:
    if len(argv) < 2 or not argv[0].isdigit():
        raise SystemExit(__doc__)
    n = int(argv[0])
    stream = interleaved(mixed_stream())
    requests = first_requests(stream, n)
    warm = stream[-1]
    for target in argv[1:]:
        label, _, spec = target.partition("=")
        if spec.startswith("ours:"):
            mode, _, url = spec[len("ours:"):].partition("@")
            rows = ours(url, mode, requests, warm)
        else:
            rows = peer(spec, requests, warm)
        for r, row in zip(requests, rows):
            print(label, json.dumps({"request": r.prompt.id, **row}), flush=True)
        tokens, wall = sum(x["tokens"] for x in rows), sum(x["latency"] for x in rows)
        print(label, f"total: {tokens} tokens in {wall:.1f} s, {tokens / wall:.2f} tok/s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
