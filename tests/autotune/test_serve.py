"""`autotune serve` on loopback with the official `openai` client (real SmolLM2, slow tier).

The store holds two tuned strategies, each with the prompts it was tuned on (GSM8K: SWIFT layer
skip; HumanEval: prompt lookup). Greedy responses must equal plain decoding token for token in
every mode (auto, plain, default), routing must send each task's prompts to its strategy, the
metrics must add up to the responses, and bad input must get OpenAI error bodies without harming
the server.
"""
from __future__ import annotations

import concurrent.futures as cf
import statistics
import subprocess
import sys
import time

import httpx
import pytest

from autotune.serving.server import ServeConfig, build_server
from autotune.store.records import ResultMetrics
from autotune.store.resolve import strategy_key
from autotune.store.storage import open_storage
from runtime.decoding import GenerationConfig
from runtime.pipeline import build_decoder, eos_ids
from search_spaces.layer_plan import uniform_skip_plan
from search_spaces.strategy import PLAIN, Strategy
from studies import Prompt, encode_prompt, load_prompts, routing_text
from tests.helpers import MAX_TOKENS, MODEL, LiveServer, chat

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def store(pool, smollm, tmp_path_factory):
    url = f"sqlite:///{tmp_path_factory.mktemp('serve') / 'store.db'}"
    n = smollm.hf_model.config.num_hidden_layers
    tuned = {
        "gsm8k": Strategy(drafter="layer-skip", draft_length=4, layer_plan=uniform_skip_plan(n, 0.2)),
        "humaneval": Strategy(drafter="prompt-lookup", draft_length=6),
    }
    with open_storage(url) as storage:
        for task, strategy in tuned.items():
            texts = [routing_text(p) for p in load_prompts(task, None, 12)]
            storage.record(strategy_key(smollm, None, task, "cpu"), strategy,
                           ResultMetrics.from_throughput(20.0), prompts=texts)
    return url, tuned


@pytest.fixture(scope="module")
def live(pool, smollm, store):
    url, _ = store
    storage = open_storage(url)
    server = build_server(ServeConfig(model=MODEL, storage=url, max_queue=64), storage, pool=pool)
    with LiveServer(server) as live:
        yield live
    storage.close()


def test_start_up_pays_the_first_call_costs(pool, store):
    """A quantised server builds its prefill's bf16 weight copies while loading (a dummy decode per
    routed strategy), not in its first request: on the 1.5B at int4 that request ran 0.11x plain."""
    from runtime.linear import bf16_prefill

    if not bf16_prefill("int4"):
        pytest.skip("this CPU has no native bf16 GEMMs: a quantised prefill runs its own kernels")
    url, _ = store
    with open_storage(url) as storage:
        server = build_server(ServeConfig(model=MODEL, storage=url, dtype="int4"), storage, pool=pool)
        lm = server.worker.decoders.decoder(PLAIN).target  # the worker is not started: no request has run
        assert lm.backend == "int4" and "linears" in lm._prefill


def plain_text(pool, smollm, prompt: Prompt, max_tokens: int = MAX_TOKENS) -> tuple[str, list[int]]:
    """What `autotune generate` prints for this prompt (plain greedy decoding), and its token ids."""
    ids = encode_prompt(prompt, smollm.tokenizer)
    out = build_decoder(pool, smollm, PLAIN).generate(ids, GenerationConfig(max_new_tokens=max_tokens,
                                                                            eos_token_ids=eos_ids(smollm)))
    return smollm.tokenizer.decode(out.tokens, skip_special_tokens=True), out.tokens


def task_prompt(task: str, offset: int) -> Prompt:
    (p,) = load_prompts(task, None, 1, offset)
    return Prompt(id=p.id, messages=(("user", routing_text(p)),))


def test_models_and_health(live):
    assert [m.id for m in live.client().models.list().data] == [MODEL]
    assert httpx.get(f"{live.url}/health").json()["status"] == "ok"


# heavy: the streamed twin (about 40 s); streamed responses stay in the default run (the tests below stream too)
@pytest.mark.parametrize("stream", [False, pytest.param(True, marks=pytest.mark.heavy)])
def test_greedy_equals_generate_in_every_mode_and_routes(live, pool, smollm, store, stream):
    _, tuned = store
    client = live.client()
    for task in ("gsm8k", "humaneval"):
        prompt = task_prompt(task, 15)  # not among the prompts the strategies were stored with
        want = plain_text(pool, smollm, prompt)
        for mode in ("auto", "plain", "default"):
            text, ids, info = chat(client, prompt.messages[0][1], mode, stream)
            assert (text, ids) == want, (task, mode)  # token for token
            if mode == "auto":
                assert info["route"] == task and info["strategy"] != "plain"
                assert info["distance"] < live.server.book.router.threshold
                assert info["drafted"] > 0  # the stored speculative strategy really ran
            else:
                assert info["route"] == mode and info["strategy"] == "plain" and info["drafted"] == 0


# heavy: a second server start-up for control decisions every 8 tokens; the default run keeps the controller in
# the loop of every routed request of test_greedy_equals_generate_in_every_mode_and_routes (request control is on by
# default) and its switches' identity on tiny models (tests/autotune/test_controller.py)
@pytest.mark.heavy
def test_routed_requests_are_controlled_and_stay_identical(pool, smollm, store):
    """Routed requests run under their own controller (decisions every 8 tokens here): the
    response says what it did, the metrics count it, and the tokens are plain decoding's; an
    explicit choice is decoded as asked, with no controller."""
    from dataclasses import replace

    from autotune.tuning.controller import ControlSettings

    url, _ = store
    storage = open_storage(url)
    server = build_server(ServeConfig(model=MODEL, storage=url, max_queue=64), storage, pool=pool,
                          adjust=lambda config: replace(config, control=ControlSettings(window=8)))
    with LiveServer(server) as live:
        before = _metric(live.url, "autotune:controlled_requests_total")
        client = live.client()
        for task, prior in (("gsm8k", "layer-skip-4"), ("humaneval", "lookup-6")):
            prompt = task_prompt(task, 16)
            want = plain_text(pool, smollm, prompt, 48)
            text, ids, info = chat(client, prompt.messages[0][1], "auto", max_tokens=48)
            assert (text, ids) == want, task
            control = info["control"]
            assert control["prior"] == prior and control["decisions"] >= 4, control
            assert control["switches"] == len(control["path"]) and 0 <= control["scoring_s"]
            _, ids, info = chat(client, prompt.messages[0][1], "plain", max_tokens=48)
            assert ids == want[1] and "control" not in info
        assert _metric(live.url, "autotune:controlled_requests_total") == before + 2
    storage.close()


def test_completions_endpoint_and_unknown_route(live, pool, smollm):
    client = live.client()
    text = "The recipe for a perfect sourdough loaf starts with"
    r = client.completions.create(model=MODEL, prompt=text, max_tokens=12, temperature=0,
                                  extra_body={"autotune": {"return_token_ids": True}})
    want = plain_text(pool, smollm, Prompt(id="c", text=text), 12)
    assert (r.choices[0].text, r.model_extra["autotune"]["token_ids"]) == want
    assert r.usage.completion_tokens == len(want[1])
    info = r.model_extra["autotune"]
    assert info["route"] == "unknown" and info["strategy"] == "plain"
    # where its time to the first token went: every stage, adding up to it
    stages = info["stages"]
    assert set(stages) == {"queue_s", "admit_s", "prefill_s", "start_s"} and min(stages.values()) >= 0
    assert sum(stages.values()) == pytest.approx(info["ttft_s"], abs=1e-4)
    assert stages["prefill_s"] > 0


def _metric(url: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def test_metrics_add_up_to_the_responses(live):
    client = live.client()
    names = ["autotune:spec_decode_num_draft_tokens_total", "autotune:spec_decode_num_accepted_tokens_total",
             "autotune:spec_decode_num_drafts_total", "autotune:generation_tokens_total"]
    before = {n: _metric(live.url, n, route="gsm8k") for n in names}
    pos_before = _metric(live.url, "autotune:spec_decode_num_accepted_tokens_per_pos_total", route="gsm8k")
    got = {"drafted": 0, "accepted": 0, "draft_rounds": 0, "tokens": 0, "per_pos": 0}
    for offset in (16, 17):
        prompt = task_prompt("gsm8k", offset)
        _, ids, info = chat(client, prompt.messages[0][1], stream=offset == 17)
        assert info["route"] == "gsm8k"
        got["drafted"] += info["drafted"]
        got["accepted"] += info["accepted"]
        got["draft_rounds"] += info["draft_rounds"]
        got["tokens"] += len(ids)
        got["per_pos"] += sum(info["accepted_per_position"])
    after = {n: _metric(live.url, n, route="gsm8k") for n in names}
    assert after[names[0]] - before[names[0]] == got["drafted"] > 0
    assert after[names[1]] - before[names[1]] == got["accepted"]
    assert after[names[2]] - before[names[2]] == got["draft_rounds"]
    assert after[names[3]] - before[names[3]] == got["tokens"]
    assert _metric(live.url, "autotune:spec_decode_num_accepted_tokens_per_pos_total", route="gsm8k") - pos_before \
        == got["per_pos"]
    text = httpx.get(f"{live.url}/metrics").text
    for needle in ("autotune:request_latency_seconds_bucket", "autotune:time_to_first_token_seconds_bucket",
                   "autotune:queue_depth", 'autotune:route_strategy_info{',
                   'autotune:route_distance_bucket{le="0.65",route="gsm8k"}'):
        assert needle in text


BAD = [
    ("not json", 400, None),
    ({"model": MODEL}, 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, "temperature"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "word " * 9000}], "max_tokens": 8}, 400, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9000}, 400, "max_tokens"),
    ({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "autotune": {"strategy": "9999"}}, 400,
     "autotune.strategy"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "autotune": {"strategy": "fastest"}}, 400,
     "autotune.strategy"),
]


@pytest.mark.parametrize("body,status,param", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_input_gets_an_openai_error_and_the_server_goes_on(live, body, status, param):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, str) else {"json": body}
    r = httpx.post(f"{live.url}/v1/chat/completions", timeout=60, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param:
        assert err["param"] == param, err
    ok = httpx.post(f"{live.url}/v1/chat/completions", timeout=120,
                    json={"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2})
    assert ok.status_code == 200


@pytest.mark.heavy  # a load test (64 requests from 16 clients), then a full queue and departing clients on a second server
def test_load_full_queue_and_disconnects(pool, smollm, store):
    """16 concurrent clients (half streaming), 64 requests: none dropped, every one correct; then a
    full queue answers 503 + Retry-After; clients that leave mid-stream do not stall the worker."""
    url, _ = store
    prompts = [task_prompt(task, 20 + i) for task in ("gsm8k", "humaneval") for i in range(4)]
    want = {p.messages[0][1]: plain_text(pool, smollm, p, 16) for p in prompts}
    with open_storage(url) as storage, LiveServer(build_server(
            ServeConfig(model=MODEL, storage=url, max_queue=64), storage, pool=pool)) as live:
        client = live.client()

        def one(i: int) -> float:
            text = prompts[i % len(prompts)].messages[0][1]
            start = time.perf_counter()
            got = chat(client, text, stream=i % 2 == 1, max_tokens=16)[:2]
            assert got == want[text], i
            return time.perf_counter() - start

        start = time.perf_counter()
        with cf.ThreadPoolExecutor(16) as ex:
            latencies = sorted(ex.map(one, range(64)))
        wall = time.perf_counter() - start
        p50, p95 = statistics.median(latencies), latencies[int(0.95 * len(latencies)) - 1]
        print(f"\nload: 64 requests, 16 clients: p50 {p50:.2f} s, p95 {p95:.2f} s, {64 / wall:.2f} requests/s")
        assert httpx.get(f"{live.url}/health").json()["queue_depth"] == 0

    with open_storage(url) as storage, LiveServer(build_server(
            ServeConfig(model=MODEL, storage=url, max_queue=2), storage, pool=pool)) as live:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Count from one to fifty."}],
                "max_tokens": 48, "temperature": 0}
        with cf.ThreadPoolExecutor(8) as ex:
            codes = list(ex.map(lambda _: httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=300), range(8)))
        full = [r for r in codes if r.status_code == 503]
        assert full and all(r.headers["Retry-After"] and r.json()["error"]["code"] == "queue_full" for r in full)
        assert any(r.status_code == 200 for r in codes)
        # clients that disconnect after the first chunk: their decoding stops at the next round
        answered = _metric(live.url, "autotune:requests_total")
        tokens = _metric(live.url, "autotune:generation_tokens_total")
        for _ in range(3):
            with httpx.stream("POST", f"{live.url}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
                next(r.iter_lines())
        _, ids, _ = chat(live.client(), "Say hi.", max_tokens=4)
        assert 1 <= len(ids) <= 4
        assert _metric(live.url, "autotune:requests_total") == answered + 1  # only "Say hi." ran to its end
        assert _metric(live.url, "autotune:generation_tokens_total") == tokens + len(ids)
        health = httpx.get(f"{live.url}/health").json()
        assert sorted(health.pop("tasks")) == ["gsm8k", "humaneval"]  # the stored tasks it routes to
        acceptance = health.pop("acceptance")  # each route's live acceptance, by strategy
        assert set(acceptance) <= {"gsm8k", "humaneval", "unknown"} and all(
            0.0 <= a <= 1.0 for figures in acceptance.values() for a in figures.values()), acceptance
        assert health.pop("context") == live.server.context
        assert health.pop("prefill") == {"chunk": 64, "in_steps": True}  # the CPU default; oneDNN float32 rows are reusable
        cache = health.pop("prefix_cache")  # the default budget, in use by the requests above
        assert 0 < cache["used_bytes"] <= cache["budget_bytes"] and 0 <= cache["hit_rate"] <= 1
        assert health == {"status": "ok", "model": MODEL, "queue_depth": 0, "running": 0}


@pytest.mark.heavy  # `autotune serve` as a process: a second interpreter loads the model again
def test_cli_serve_starts_and_exits_0_on_sigterm(store, tmp_path):
    url, _ = store
    import signal
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "autotune.cli", "serve", "--model", MODEL, "--storage", url,
                             "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 240
        while True:
            assert proc.poll() is None, proc.communicate()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline
            time.sleep(0.5)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                       json={"model": MODEL, "prompt": "Hello", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and "autotune" in r.json()
        # the port is taken now: a second server is one line, exit 2
        second = subprocess.run([sys.executable, "-m", "autotune.cli", "serve", "--model", MODEL, "--port", str(port)],
                                capture_output=True, text=True, timeout=120)
        assert second.returncode == 2 and "cannot listen" in second.stderr and "Traceback" not in second.stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("args,needle", [
    (["--model", "no-such-model"], "unknown model"),
    (["--model", MODEL, "--storage", "postgresql://x@127.0.0.1:1/db"], "cannot open storage"),
    (["--model", MODEL, "--max-queue", "0"], "--max-queue"),
    (["--model", MODEL, "--store-prompts"], "--store-prompts applies to adaptive serving"),
    (["--model", MODEL, "--adaptive", "--max-routes", "0"], "max_routes=0 must be a positive integer"),
])
def test_cli_serve_startup_errors(args, needle):
    proc = subprocess.run([sys.executable, "-m", "autotune.cli", "serve", *args, "--port", "0"],
                          capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], proc.stderr

