"""`autotune serve` in front of clients it cannot trust (real SmolLM2, slow tier, over HTTP).

The API key guards /v1/* while probes and scrapers stay open; a client's mistake is a 400 naming
the field, never a 500, and no error body shows a path, a storage URL, an exception's class or
another key's model; an oversized body is refused unread; a full queue answers before any work;
a request past ``--request-timeout`` gets 504 and stops costing decode time; one whose client
left costs nothing more, queued or running; a completion's tokens end at its stop string.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import re
import socket
import time

import httpx
import openai
import pytest

from autotune.serving.limits import Limits
from autotune.serving.server import ServeConfig, build_server
from autotune.store.records import ResultMetrics, StrategyKey
from autotune.store.resolve import strategy_key
from autotune.store.storage import open_storage
from search_spaces.strategy import Strategy
from tests.helpers import HW, MODEL, LiveServer, chat, metric

pytestmark = pytest.mark.slow

KEY = "test-key-5f2a"
AUTH = {"Authorization": f"Bearer {KEY}"}
OTHER_MODEL = "other-org/secret-model"  # a stored key this server must never name
HI = [{"role": "user", "content": "hi"}]
LEAKS = re.compile(r"/work|/tmp|/home|/root|sqlite:|postgresql|Traceback|\b[A-Z]\w*(Error|Exception)\b")


@pytest.fixture(scope="module")
def store_url(tmp_path_factory) -> str:
    """An empty store but for one strategy of another model (id 1)."""
    url = f"sqlite:///{tmp_path_factory.mktemp('hardening') / 'store.db'}"
    with open_storage(url) as storage:
        storage.record(StrategyKey(OTHER_MODEL, "0123456789ab", "", "gsm8k", HW),
                       Strategy(drafter="prompt-lookup", draft_length=4), ResultMetrics.from_throughput(10.0))
    return url


def _live(pool, url: str, **cfg):
    storage = open_storage(url)
    server = build_server(ServeConfig(model=MODEL, storage=url, **cfg), storage, pool=pool)
    return storage, LiveServer(server)


@pytest.fixture(scope="module")
def keyed(pool, smollm, store_url):
    """A server that wants the API key (and has the default body limit and deadline)."""
    storage, live = _live(pool, store_url, limits=Limits(api_key=KEY))
    with live:
        yield live
    storage.close()


def _client(live: LiveServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=key, max_retries=0, timeout=120)


def _post(live: LiveServer, body, path: str = "/v1/chat/completions", **kw) -> httpx.Response:
    return httpx.post(f"{live.url}{path}", json=body, headers=AUTH, timeout=120, **kw)


def _assert_error_body(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert not LEAKS.search(r.text), r.text
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err



# ---------------------------------------------------------------------- the API key
def test_api_key_guards_v1_and_leaves_probes_open(keyed):
    for path in ("/v1/models", "/v1/chat/completions"):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = httpx.post(f"{keyed.url}{path}", json={"model": MODEL, "messages": HI}, headers=headers) \
                if path.endswith("completions") else httpx.get(f"{keyed.url}{path}", headers=headers)
            _assert_error_body(r, 401, code="invalid_api_key")
    with pytest.raises(openai.AuthenticationError):
        _client(keyed, "wrong").models.list()
    assert [m.id for m in _client(keyed, KEY).models.list().data] == [MODEL]
    _, ids, _ = chat(_client(keyed, KEY), "Say hi.", max_tokens=3)
    assert 1 <= len(ids) <= 3
    assert httpx.get(f"{keyed.url}/health").status_code == 200  # probes and scrapers carry no key
    assert httpx.get(f"{keyed.url}/metrics").status_code == 200


# ---------------------------------------------------------------------- a client's mistakes
BAD = [  # (what, fields added to a good chat body, param, code)
    ("unicode digit id", {"autotune": {"strategy": "²"}}, "autotune.strategy", None),
    ("31-digit id", {"autotune": {"strategy": "1" * 31}}, "autotune.strategy", None),
    ("31-digit int id", {"autotune": {"strategy": 10**30}}, "autotune.strategy", None),
    ("another model's id", {"autotune": {"strategy": "1"}}, "autotune.strategy", "strategy_mismatch"),
    ("negative seed", {"seed": -1}, "seed", None),
    ("seed over 2^63-1", {"seed": 2**63}, "seed", None),
    ("unknown role", {"messages": [{"role": "wizard", "content": "hi"}]}, None, None),
    ("logprobs", {"logprobs": True}, "logprobs", None),
    ("top_logprobs", {"top_logprobs": 3}, "top_logprobs", None),
    ("logit_bias", {"logit_bias": {"42": 10}}, "logit_bias", None),
    ("tools", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", None),
    ("tool_choice", {"tool_choice": "auto"}, "tool_choice", None),
    ("response_format", {"response_format": {"type": "json_object"}}, "response_format", None),
    ("65 stop strings", {"stop": [f"s{i}" for i in range(65)]}, "stop", None),
    ("a 257-character stop", {"stop": ["x" * 257]}, "stop", None),
]


def test_client_mistakes_get_400_naming_the_field_and_no_internals(keyed):
    wrong = []
    for what, fields, param, code in BAD:
        r = _post(keyed, {"model": MODEL, "messages": HI, "max_tokens": 2, **fields})
        try:
            err = _assert_error_body(r, 400, param, code)
            if param in ("logprobs", "top_logprobs", "logit_bias", "tools", "tool_choice", "response_format"):
                assert f"{param} is not supported by this server" in err["message"], err
        except AssertionError as exc:
            wrong.append(f"{what}: {exc}")
    legacy = _post(keyed, {"model": MODEL, "prompt": "a", "logprobs": 2}, "/v1/completions")
    _assert_error_body(legacy, 400, "logprobs")  # the legacy endpoint refuses it too
    assert not wrong, "\n".join(wrong)


def test_no_error_body_names_another_keys_model(keyed):
    r = _post(keyed, {"model": MODEL, "messages": HI, "max_tokens": 2, "autotune": {"strategy": "1"}})
    _assert_error_body(r, 400, "autotune.strategy", "strategy_mismatch")
    assert OTHER_MODEL not in r.text, r.text


def test_accepted_edges_still_serve(keyed):
    """What the limits leave allowed: 64 stop strings of 256 characters, seed 2^63-1, logprobs false."""
    body = {"model": MODEL, "messages": HI, "max_tokens": 2, "seed": 2**63 - 1, "logprobs": False,
            "stop": [f"{i:03d}" + "z" * 253 for i in range(64)]}
    assert _post(keyed, body).status_code == 200


TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
            "{{ raise_exception('System messages must come first') }}{% endif %}"
            "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_chat_template_refusal_is_a_400(keyed, monkeypatch):
    """A template that refuses some conversations (as Mistral's and Llama 2's do) answers 400."""
    monkeypatch.setattr(keyed.server.tokenizer, "chat_template", TEMPLATE)
    body = {"model": MODEL, "messages": [*HI, {"role": "system", "content": "late"}], "max_tokens": 2}
    err = _assert_error_body(_post(keyed, body), 400, "messages", "invalid_messages")
    assert "System messages must come first" in err["message"]
    assert _post(keyed, {"model": MODEL, "messages": HI, "max_tokens": 2}).status_code == 200


def test_internal_errors_are_500_with_a_fixed_message(keyed, monkeypatch):
    secret = RuntimeError(f"ValueError at /work/x.py opening sqlite:////tmp/store.db for {OTHER_MODEL}")

    def boom(*args, **kwargs):
        raise secret

    body = {"model": MODEL, "messages": HI, "max_tokens": 2}
    for where, obj, name, code in [("a store lookup", keyed.server.book, "choose", "internal_error"),
                                   ("the decode thread", keyed.server.worker.decoders, "decoder", "decode_failed")]:
        with monkeypatch.context() as m:
            m.setattr(obj, name, boom)
            r = _post(keyed, body)
        _assert_error_body(r, 500, code=code)
        assert OTHER_MODEL not in r.text and "internal error" in r.json()["error"]["message"], (where, r.text)
    assert _post(keyed, body).status_code == 200


# ---------------------------------------------------------------------- body size
def test_a_body_over_the_limit_gets_413_before_it_is_parsed(keyed):
    limit = Limits.max_body_bytes
    big = b"{" + b" " * limit + b"}"  # not even JSON: a parser would have answered 400
    _assert_error_body(httpx.post(f"{keyed.url}/v1/chat/completions", content=big, headers=AUTH), 413,
                       code="request_too_large")

    def chunked():  # no Content-Length: the bytes are counted as they arrive
        for i in range(0, len(big), 1 << 16):
            yield big[i : i + (1 << 16)]

    r = httpx.post(f"{keyed.url}/v1/chat/completions", content=chunked(), headers=AUTH)
    assert "content-length" not in r.request.headers
    _assert_error_body(r, 413, code="request_too_large")
    assert _post(keyed, {"model": MODEL, "messages": HI, "max_tokens": 2}).status_code == 200


# ---------------------------------------------------------------------- a full queue, deadlines
LONG = {"model": MODEL, "prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "max_tokens": 2000, "temperature": 0}
TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def hurried(pool, smollm, store_url):
    """One running request, one waiting place and a short deadline (no key)."""
    storage, live = _live(pool, store_url, max_queue=1, max_batch=1, limits=Limits(request_timeout_s=TIMEOUT_S))
    with live:
        yield live
    storage.close()


def _wait_idle(live: LiveServer) -> None:
    deadline = time.time() + 30
    while httpx.get(f"{live.url}/health").json()["queue_depth"]:
        assert time.time() < deadline, "the worker never let go of the timed-out requests"
        time.sleep(0.1)


@pytest.mark.heavy  # a queue-full test on a server start-up of its own, waiting out two timeouts
def test_full_queue_answers_503_before_tokenising_or_a_store_lookup(hurried):
    """The probe would be a 400 once tokenised (too long) or looked up (no strategy 77): a 503
    shows the queue was checked first."""
    url = f"{hurried.url}/v1/completions"
    with cf.ThreadPoolExecutor(2) as ex:  # one decoding, one waiting: the only place is taken
        running = ex.submit(httpx.post, url, json=LONG, timeout=120)
        time.sleep(0.5)
        waiting = ex.submit(httpx.post, url, json=LONG, timeout=120)
        time.sleep(0.5)
        probe = httpx.post(url, json={"model": MODEL, "prompt": "word " * 9000, "autotune": {"strategy": "77"}})
        _assert_error_body(probe, 503, code="queue_full")
        assert probe.headers["Retry-After"]
        assert [running.result().status_code, waiting.result().status_code] == [504, 504]
    _wait_idle(hurried)


@pytest.mark.heavy  # waits out three request timeouts (on the queue-full test's server)
def test_request_timeout_gives_504_and_frees_its_place(hurried):
    url = f"{hurried.url}/v1/completions"
    tokens = metric(hurried.url, "autotune:generation_tokens_total")
    with cf.ThreadPoolExecutor(2) as ex:  # one decoding, one waiting behind it: both past the deadline
        running = ex.submit(httpx.post, url, json=LONG, timeout=120)
        time.sleep(0.5)
        waiting = ex.submit(httpx.post, url, json=LONG, timeout=120)
        for r in (running.result(), waiting.result()):
            _assert_error_body(r, 504, code="request_timeout")
    _wait_idle(hurried)
    # a stream whose headers are out ends with an SSE error event, and its decoding stops too
    with httpx.stream("POST", url, json={**LONG, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and '"request_timeout"' in events[-2] and len(events) > 3, events[-3:]
    _wait_idle(hurried)
    _, ids, _ = chat(hurried.client(), "Say hi.", max_tokens=3)  # the place is free again
    # none of the stopped requests ran to its end: only "Say hi." counts its tokens
    assert metric(hurried.url, "autotune:generation_tokens_total") == tokens + len(ids)


# ---------------------------------------------------------------------- departed clients
COUNT = {**LONG, "max_tokens": 200}  # counting never meets EOS within 200 tokens


@pytest.fixture(scope="module")
def patient(pool, smollm, store_url):
    """The default deadline and one waiting place (no key)."""
    storage, live = _live(pool, store_url, max_queue=1)
    with live:
        yield live
    storage.close()


def _send_raw(live: LiveServer, body: dict) -> socket.socket:
    """A non-streaming request on a bare socket the test closes without reading the answer."""
    host, port = live.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    payload = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (host.encode(), len(payload), payload))
    return sock


def _depth(live: LiveServer) -> int:
    return httpx.get(f"{live.url}/health").json()["queue_depth"]


def _cancelled(live: LiveServer) -> float:
    return metric(live.url, 'autotune:requests_cancelled_total{reason="client_disconnected"}')


@pytest.mark.heavy  # a client that leaves mid-decode, on a server start-up of its own (timed by sleeps)
def test_a_departed_client_stops_its_running_request(patient):
    tokens, cancelled = metric(patient.url, "autotune:generation_tokens_total"), _cancelled(patient)
    sock = _send_raw(patient, COUNT)
    time.sleep(1.0)  # past its first rounds
    assert _depth(patient) == 1
    sock.close()
    _wait_idle(patient)
    assert metric(patient.url, "autotune:generation_tokens_total") - tokens < 100  # it never ran to its end
    assert _cancelled(patient) == cancelled + 1
    _, ids, _ = chat(patient.client(), "Say hi.", max_tokens=3)  # the worker serves the next one
    assert metric(patient.url, "autotune:generation_tokens_total") == tokens + len(ids)


@pytest.mark.heavy  # a client that leaves the queue (on the test above's server)
def test_a_departed_client_leaves_the_queue_undecoded(patient):
    tokens, cancelled = metric(patient.url, "autotune:generation_tokens_total"), _cancelled(patient)
    with cf.ThreadPoolExecutor(1) as ex:
        running = ex.submit(httpx.post, f"{patient.url}/v1/completions", json={**COUNT, "max_tokens": 150},
                            timeout=120)
        time.sleep(0.5)
        sock = _send_raw(patient, COUNT)  # waits behind the running one
        deadline = time.time() + 10
        while _depth(patient) < 2:
            assert time.time() < deadline, "the second request never reached the queue"
            time.sleep(0.05)
        sock.close()
        while _depth(patient) > 1 and running.running():  # it leaves at once, before the running one ends
            time.sleep(0.05)
        assert running.running(), "the running request ended before the queued one left: make it longer"
        done = running.result()
    assert done.status_code == 200, done.text
    _wait_idle(patient)
    assert _cancelled(patient) == cancelled + 1
    # only the request that stayed counts its tokens: the departed one never decoded
    stayed = done.json()["usage"]["completion_tokens"]
    assert metric(patient.url, "autotune:generation_tokens_total") == tokens + stayed


def test_usage_and_token_ids_end_at_the_stop_string(pool, smollm, tmp_path):
    """Prompt lookup accepts several tokens a round: those past the stop string are not the completion's."""
    url = f"sqlite:///{tmp_path / 'store.db'}"
    with open_storage(url) as storage:
        sid = storage.record(strategy_key(smollm, None, "lookup", "cpu"),
                             Strategy(drafter="prompt-lookup", draft_length=8), ResultMetrics.from_throughput(20.0))
    storage, live = _live(pool, url)
    lines = "".join(f"item {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(1, 7))
    body = {"model": MODEL, "prompt": lines + "item 7:", "max_tokens": 40, "temperature": 0, "stop": ["lazy"],
            "autotune": {"strategy": str(sid), "return_token_ids": True}}
    with live:
        r = httpx.post(f"{live.url}/v1/completions", json=body, timeout=120)
    storage.close()
    assert r.status_code == 200, r.text
    out = r.json()
    ids, text = out["autotune"]["token_ids"], out["choices"][0]["text"]
    assert text == " the quick brown fox jumps over the " and out["choices"][0]["finish_reason"] == "stop", out
    assert out["usage"]["completion_tokens"] == len(ids)
    tok = smollm.tokenizer
    assert "lazy" in tok.decode(ids) and "lazy" not in tok.decode(ids[:-1])  # through the token that completed it
