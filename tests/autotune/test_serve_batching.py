"""Continuous batching in `autotune serve` (real SmolLM2, fp32): concurrent requests with different
strategies decode side by side and each returns exactly what it returns alone."""
from __future__ import annotations

import concurrent.futures as cf
import threading
import time

import pytest

from autotune.errors import SettingError
from autotune.serving.server import ServeConfig, build_server
from autotune.serving.sizing import batch_size, kv_bytes_per_slot
from autotune.serving.worker_config import Hooks
from autotune.store.records import ResultMetrics
from autotune.store.resolve import strategy_key
from autotune.store.storage import open_storage
from search_spaces.strategy import Strategy
from tests.helpers import MODEL, LiveServer, chat, metric, routing_texts

pytestmark = pytest.mark.slow

STRATEGIES = {  # name -> (draft, strategy)
    "chain": (MODEL, Strategy(draft_length=4, draft_precision="int8")),
    "tree": (MODEL, Strategy(draft_length=3, tree_widths=(2, 2, 1), draft_precision="int8")),
    "lookup": (MODEL, Strategy(drafter="prompt-lookup", draft_length=6)),  # the key names the served draft
}


class Gate:
    """The worker's fault hook: while shut, each admission waits (at most 30 s) until it opens."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self._open.set()

    def __call__(self, job) -> None:
        self._open.wait(30)

    def shut(self) -> None:
        self._open.clear()

    def open(self) -> None:
        self._open.set()


class Steps:
    """The worker's on_step hook: each batched step's size, and whether a long prompt's prefill
    was under way then (``worker`` is the server's, set once it is built)."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.prefilling: list[bool] = []
        self.prefills: list[int] = []  # prompts being prefilled at each step
        self.worker = None

    def __call__(self, batch) -> None:
        self.sizes.append(len(batch))
        self.prefilling.append(bool(self.worker.loop.prefilling))
        self.prefills.append(len(self.worker.loop.prefilling))


class Live:
    """A running server of the stored strategies, with its hooks."""

    def __init__(self, pool, url: str, **adjusted) -> None:
        from dataclasses import replace

        self.storage = open_storage(url)
        self.steps, self.gate = Steps(), Gate()
        adjust = (lambda config: replace(config, **adjusted)) if adjusted else None
        server = build_server(ServeConfig(model=MODEL, draft=MODEL, storage=url, max_batch=8), self.storage,
                              pool=pool, hooks=Hooks(on_step=self.steps, fault=self.gate), adjust=adjust)
        self.steps.worker = server.worker
        self.running = LiveServer(server)

    def __enter__(self) -> "Live":
        self.running.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.running.__exit__(*exc)
        self.storage.close()


@pytest.fixture(scope="module")
def store(smollm, tmp_path_factory):
    url = f"sqlite:///{tmp_path_factory.mktemp('batch') / 'store.db'}"
    with open_storage(url) as storage:
        for name, (draft, strategy) in STRATEGIES.items():
            storage.record(strategy_key(smollm, draft or None, name, "cpu"), strategy,
                           ResultMetrics.from_throughput(10.0))
        ids = {b.key.task: str(b.id) for b in storage.list_best()}
    return url, ids


@pytest.fixture(scope="module")
def served(pool, store):
    """The server as served: load-aware draft lengths."""
    with Live(pool, store[0]) as live:
        yield live


@pytest.fixture(scope="module")
def fixed(pool, store):
    """A server whose requests draft at their strategies' own lengths (no load-aware choice)."""
    with Live(pool, store[0], load_aware=False) as live:
        yield live


@pytest.fixture
def live(fixed, store):
    """The default run's one server (the strategies' own lengths); load-aware lengths start a second, in the heavy tier."""
    return fixed.running, store[1], fixed.steps.sizes


def _together(live: Live, jobs):
    """Send ``jobs`` (text, strategy) at once: the worker holds the first until all are queued."""
    worker = live.running.server.worker
    live.gate.shut()
    client = live.running.client()
    with cf.ThreadPoolExecutor(len(jobs)) as ex:
        futures = [ex.submit(chat, client, text, strategy, max_tokens=40) for text, strategy in jobs]
        deadline = time.monotonic() + 30
        while worker.requests.waiting < len(jobs) - 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        live.gate.open()
        results = [f.result() for f in futures]
    return results


@pytest.mark.parametrize("load_aware", [
    False,  # every strategy drafts in the batch: the default run's batching identity
    # heavy: the same identity with load-aware lengths, which may draft less or not at all (8 more requests)
    pytest.param(True, marks=pytest.mark.heavy),
])
def test_concurrent_requests_with_different_strategies_equal_their_solo_answers(request, store, load_aware):
    """Plain, a chain, a tree and prompt lookup side by side. With the strategies' own lengths,
    every one drafts in the batch; with load-aware lengths, some may draft less or not at all. The
    answers are the same either way."""
    server = request.getfixturevalue("served" if load_aware else "fixed")
    running, ids, sizes = server.running, store[1], server.steps.sizes
    texts = routing_texts("humaneval", 2, 20) + routing_texts("gsm8k", 2, 20)
    jobs = list(zip(texts, ["plain", ids["chain"], ids["tree"], ids["lookup"]]))
    alone = [chat(running.client(), text, strategy, max_tokens=40) for text, strategy in jobs]
    sizes.clear()
    together = _together(server, jobs)
    assert max(sizes) == 4, sizes  # the four decoded side by side
    for (text, strategy), a, b in zip(jobs, alone, together):
        assert b[:2] == a[:2], strategy  # text and token ids
    infos = [b[2] for b in together]
    assert [i["strategy"] for i in infos][1:] == [ids["chain"], ids["tree"], ids["lookup"]]
    assert infos[0]["drafted"] == 0
    if not load_aware:
        assert all(i["drafted"] > 0 for i in infos[1:]), infos
        assert max(i["accepted_per_position"][1] if len(i["accepted_per_position"]) > 1 else 0 for i in infos) > 0
    assert metric(running.url, "autotune:batch_size_count") >= len(sizes)


def test_the_draft_models_depth_forward_is_priced_once_for_the_sequences_drafting_there(fixed, store):
    """At start-up the server times the draft model's depth forward for 1, 2, 4 and 8 sequences
    (``DraftCost``); batched steps where chains drafted refine it, each phase with fewer forwards
    than drafts (here at the strategies' own lengths)."""
    ids = store[1]
    worker = fixed.running.server.worker
    from autotune.serving.costs import draft_key

    chain, tree = STRATEGIES["chain"][1], STRATEGIES["tree"][1]
    key = draft_key(worker.decoders.decoder(chain))
    assert key is not None and key == draft_key(worker.decoders.decoder(tree))  # one int8 copy of the draft drafts both
    cost = worker.figures.draft_costs[key]
    assert cost.known and [m for _, m, _ in cost.profile] == [1, 2, 4, 8]
    assert 0 < cost.forward_s(1) <= cost.forward_s(8) <= 8 * cost.forward_s(1)  # a fit of timings: no strict margin
    seen = list(cost.steps)
    _together(fixed, list(zip(routing_texts("humaneval", 2, 20), [ids["chain"]] * 2)))
    new = list(cost.steps)[len(seen):] if len(seen) < cost.steps.maxlen else list(cost.steps)
    assert any(drafts > depths for depths, drafts, _ in new), new  # two chains drafted in one phase


@pytest.mark.heavy  # a server start-up of its own for one request's figure (no output is compared)
def test_a_finished_request_teaches_its_route_the_acceptance_it_drafted_at(pool, store):
    """Where a request ends, what it accepted of what it drafted becomes its route's live figure
    for its strategy (``RouteAcceptance``), the start of later sequences' acceptance estimates."""
    import httpx

    ids = store[1]
    with Live(pool, store[0], acceptance_min_drafts=1) as fresh:
        running = fresh.running
        _, _, info = chat(running.client(), routing_texts("humaneval", 1, 30)[0], ids["chain"], max_tokens=40)
        figures_by_route = httpx.get(f"{running.url}/health").json()["acceptance"]  # what an operator reads
    assert info["drafted"] > 0, info
    (route, figures), = figures_by_route.items()
    assert route == info["route"] and list(figures.values()) == [pytest.approx(info["accepted"] / info["drafted"], abs=1e-4)]


def test_a_request_that_leaves_does_not_stop_its_batch_mates(fixed, store):
    """Three requests together, one of them with a budget of 4 tokens: it leaves after a few
    steps; the others go on and still equal their solo answers."""
    running, ids = fixed.running, store[1]
    texts = routing_texts("gsm8k", 3, 30)
    client = running.client()
    want = [chat(client, t, ids["lookup"], max_tokens=40)[:2] for t in texts[1:]]
    worker = running.server.worker
    fixed.gate.shut()
    with cf.ThreadPoolExecutor(3) as ex:
        short = ex.submit(chat, client, texts[0], "plain", max_tokens=4)
        longer = [ex.submit(chat, client, t, ids["lookup"], max_tokens=40) for t in texts[1:]]
        while worker.requests.waiting < 2:
            time.sleep(0.02)
        fixed.gate.open()
        assert len(short.result()[1]) == 4
        assert [f.result()[:2] for f in longer] == want


def test_a_served_requests_draft_catches_up_on_the_prompt_before_its_first_round(live, monkeypatch):
    """The worker runs a joining request's draft catch-up over the prompt before its first round
    (timed as prefill, as ``Decoder.generate`` does): inside the round it counted as the chain's
    draft time, and a GSM8K request's controller stopped a chain that paid (docs/benchmarks.md,
    issue 30 run 10)."""
    from runtime.drafters import ModelDrafter

    running, ids, _ = live
    pending: list[int] = []
    real = ModelDrafter.propose_steps

    def propose_steps(self, *args, **kwargs):
        pending.append(len(self.pending))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ModelDrafter, "propose_steps", propose_steps)
    # a short prompt: alone, a request drafts only where its draft's catch-up pays back over the
    # tokens it has left (``starts_alone``), and the int4 draft's catch-up over a few-shot GSM8K
    # prompt (~770 tokens) took 1.0 s on this CPU, more than drafting could save over 64 tokens
    text = routing_texts("translation", 1, 40)[0]
    info = chat(running.client(), text, ids["chain"], max_tokens=32)[2]
    assert info["drafted"] > 0
    assert pending and pending[0] == 1, pending[:3]  # only the newest token was left for the first round


def test_a_long_prompt_prefills_in_chunks_while_its_batch_mates_step(fixed, store):
    """A prompt longer than the prefill chunk joins a running request: its chunks ride one per step
    inside the batch's target forward (the served target's rows are reusable: oneDNN's float32
    kernels), so the running request is not held up for the whole prefill, and both answers equal
    their solo ones under the same chunking. The long prompt opts out of the prefix cache (its solo
    run would leave its rows, and the second would prefill nothing)."""
    running, ids = fixed.running, store[1]
    server, worker = running.server, running.server.worker
    short = "Count from one to fifty in words, separated by commas."  # one chunk, and 40 tokens of answer
    long = routing_texts("gsm8k", 1, 30)[0]  # some 500 tokens: 8 chunks
    assert server.prefill_chunk == 64  # the CPU's default: a chunk a step
    client = running.client()
    try:
        want_short = chat(client, short, "plain", max_tokens=40)
        want_long = chat(client, long, ids["lookup"], max_tokens=8, cache_prompt=False)
        assert running.server.prefill() == {"chunk": 64, "in_steps": True}
        chunks_before = metric(running.url, "autotune:prefill_chunks_in_steps_total")
        alone_before = metric(running.url, "autotune:prefill_chunks_total")
        mark = len(fixed.steps.prefilling)
        fixed.gate.shut()
        with cf.ThreadPoolExecutor(2) as ex:
            got_short = ex.submit(chat, client, short, "plain", max_tokens=40)
            deadline = time.monotonic() + 30
            while worker.running == 0 and time.monotonic() < deadline:  # the short one is being admitted
                time.sleep(0.02)
            got_long = ex.submit(chat, client, long, ids["lookup"], max_tokens=8, cache_prompt=False)
            while worker.requests.waiting < 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            fixed.gate.open()
            got = got_short.result(), got_long.result()
        during = fixed.steps.prefilling[mark:]
    finally:
        fixed.gate.open()
    assert got[0][:2] == want_short[:2] and got[1][:2] == want_long[:2]
    chunks = metric(running.url, "autotune:prefill_chunks_in_steps_total") - chunks_before
    assert chunks >= 3, chunks  # the long prompt's chunks (8 of 64 tokens) rode the short one's steps
    assert metric(running.url, "autotune:prefill_chunks_total") == alone_before  # none ran alone between steps
    assert sum(during) >= chunks, (chunks, during)  # each in a step taken while it prefilled


def test_short_prompts_prefill_side_by_side_riding_the_running_step(fixed, store):
    """Requests that arrive together while one runs are admitted together: their prompts (a chunk
    each, within the step's prompt-row budget) ride the running request's steps side by side, and
    every answer is its solo one."""
    running, worker = fixed.running, fixed.running.server.worker
    texts = ["Say hi.", "Name a colour.", "What is two plus two?"]
    client = running.client()
    long = "Count from one to fifty in words, separated by commas."
    want = [chat(client, long, "plain", max_tokens=40)] + [chat(client, t, "plain", max_tokens=8) for t in texts]
    mark = len(fixed.steps.prefills)
    fixed.gate.shut()
    try:
        with cf.ThreadPoolExecutor(4) as ex:
            futures = [ex.submit(chat, client, long, "plain", max_tokens=40)]
            deadline = time.monotonic() + 30
            while worker.running == 0 and time.monotonic() < deadline:
                time.sleep(0.02)
            futures += [ex.submit(chat, client, t, "plain", max_tokens=8) for t in texts]
            while worker.requests.waiting < len(texts) and time.monotonic() < deadline:
                time.sleep(0.02)
            fixed.gate.open()
            got = [f.result() for f in futures]
    finally:
        fixed.gate.open()
    assert [g[1] for g in got] == [w[1] for w in want]
    assert max(fixed.steps.prefills[mark:]) >= 2, fixed.steps.prefills[mark:]  # prefilled side by side


def test_max_batch_that_does_not_fit_memory_is_a_start_up_error(smollm):
    slot = kv_bytes_per_slot(smollm.hf_model.config, 8192)
    assert slot == 2 * 30 * 3 * 64 * 4 * 8192  # SmolLM2: 30 layers, 3 KV heads of 64
    with pytest.raises(SettingError, match="--max-batch 64 x a 8192-token context needs"):
        batch_size(64, slot, 8192, free=2 * 2**30)
    assert batch_size(None, slot, 8192, free=2 * 2**30) == 4  # 80% of 2 GiB / 360 MiB
    assert batch_size(None, slot, 8192, free=None) == 16
    assert batch_size(None, 1, 8192, free=2**40) == 16


def _answered(url: str) -> float:
    """Requests the server answered so far (its /metrics ``requests_total``, every route and finish)."""
    import httpx

    lines = httpx.get(f"{url}/metrics", timeout=30).text.splitlines()
    return sum(float(line.rpartition(" ")[2]) for line in lines if line.startswith("autotune:requests_total{"))


@pytest.mark.heavy  # a load test: 26 requests, two modes at 1 and 4 clients, two rounds each
def test_loadtest_measures_each_point_and_draws_them(live, tmp_path):
    from autotune.measure.loadtest import format_points, load_test, read_points
    from autotune.reports.load_plots import load_plot
    from studies.stream import load_stream

    running, _, _ = live
    requests = load_stream("mixed")[:4]
    before = _answered(running.url)
    points = load_test([("new", running.url)], requests, ["plain", "default"], [1, 4], max_tokens=8, timeout_s=120,
                       per_client=1, min_requests=2, rounds=2, warmup=1)
    # two rounds of each mode at each level, pooled into one point; one unmeasured request per mode first
    assert [(p.mode, p.concurrency, p.requests, p.rounds) for p in points] == [
        ("plain", 1, 4, 2), ("default", 1, 4, 2), ("plain", 4, 8, 2), ("default", 4, 8, 2)]
    assert _answered(running.url) - before == 2 + 4 * 2 + 8 * 2
    assert all(len(p.round_tokens_per_s) == 2 and min(p.round_tokens_per_s) > 0 for p in points)
    points = [p for p in points if p.mode == "plain"]
    assert all(p.tokens > 0 and p.tokens_per_s > 0 and p.latency_p95_s >= p.latency_p50_s for p in points)
    assert points[1].mean_batch is not None and points[1].mean_batch > 1  # four clients were batched
    assert "| new | plain | 4 | 8 |" in format_points(points) and points[1].draft_per_request == 0
    path = tmp_path / "points.json"
    import json

    path.write_text(json.dumps({"points": [p.as_dict() for p in points]}))
    assert read_points(path) == points
    assert load_plot(points, tmp_path / "load.png").stat().st_size > 0


def test_a_request_past_max_context_gets_a_400(pool, smollm, tmp_path):
    import httpx

    url = f"sqlite:///{tmp_path / 'store.db'}"
    storage = open_storage(url)
    server = build_server(ServeConfig(model=MODEL, storage=url, max_batch=2, max_context=64), storage, pool=pool)
    with LiveServer(server) as running:
        body = {"model": MODEL, "prompt": "one two three four five six seven eight", "max_tokens": 60}
        r = httpx.post(f"{running.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert "64 tokens" in r.json()["error"]["message"]
        assert httpx.post(f"{running.url}/v1/completions", json={**body, "max_tokens": 8}, timeout=60).status_code == 200
    storage.close()
