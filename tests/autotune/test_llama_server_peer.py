"""llama-server as a ``loadtest`` peer (``autotune.measure.llama_server``): configuration parsing, the
command line of each configuration, the process's start and stop, the plain OpenAI client, the
comparison against the best peer and the one-line errors, always (a fake server script stands in
for llama-server); one load point against the real llama-server when ``make peers`` has built it."""
from __future__ import annotations

import json
import math
import os
import signal
import stat
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from autotune.errors import MethodError, RemoteError, SettingError
from autotune.measure import llama_server as ls
from autotune.measure import peers
from autotune.measure.loadtest import PEER_MODE, LoadPoint, compare, format_comparisons
from autotune.measure.openai_client import PlainClient, read_stream
from autotune.measure.replay import ReplaySettings
from studies import Prompt, StreamRequest
from tests.helpers import assert_one_line_error, run


# ---------------------------------------------------------------------- configurations
def test_peer_configs_parse_in_order_and_default_to_all() -> None:
    assert ls.parse_peer("llama-server:ngram-simple,plain") == ("ngram-simple", "plain")
    assert ls.parse_peer("llama-server") == tuple(ls.CONFIGS) == ("plain", "ngram-simple", "spec-default",
                                                                  "draft-simple")
    assert ls.label("spec-default") == "llama-server:spec-default"


@pytest.mark.parametrize("text, needle", [
    ("llama-server:plain,turbo", "unknown llama-server configuration 'turbo'; configurations: plain, ngram-simple, "
                                 "spec-default, draft-simple"),
    ("vllm:plain", "unknown peer 'vllm'"),
    ("llama-server:", "names no configuration; configurations: plain"),
    ("llama-server:plain,plain", "'plain' is listed twice"),
])
def test_a_bad_peer_names_what_exists(text: str, needle: str) -> None:
    with pytest.raises(MethodError, match=needle.replace("(", r"\(")):
        ls.parse_peer(text)


def test_peer_settings_are_validated() -> None:
    for bad, needle in (({"slots": 0}, "--peer-slots"), ({"slots": 2, "threads": 0}, "--peer-threads"),
                        ({"slots": 2, "request_context": 1}, "--peer-context")):
        with pytest.raises(SettingError, match=needle):
            ls.PeerSettings(**bad)
    with pytest.raises(MethodError, match="configurations: plain"):
        ls.PeerSettings(slots=1, configs=("nope",))
    assert not ls.PeerSettings(slots=1, configs=("plain", "spec-default")).needs_draft
    assert ls.PeerSettings(slots=1).needs_draft  # every configuration, draft-simple among them


def _argv(config: str) -> list[str]:
    plan = ls.PeerPlan(ls.PeerSettings(slots=4, configs=(config,)), Path("/bin/llama-server"), Path("/m/target.gguf"),
                       Path("/m/draft.gguf"), threads=2, context=2048)
    return ls.server_argv(plan, config, port=8123)


def test_every_config_shares_threads_slots_and_context() -> None:
    for config in ls.CONFIGS:
        argv = _argv(config)
        assert argv[:3] == ["/bin/llama-server", "-m", "/m/target.gguf"], config
        pairs = dict(zip(argv[3:], argv[4:]))
        assert (pairs["--port"], pairs["-t"], pairs["-tb"], pairs["-np"], pairs["-c"]) == ("8123", "2", "2", "4", "8192")
        assert pairs["--host"] == "127.0.0.1"


def test_each_config_adds_its_own_speculation_flags() -> None:
    tail = {config: _argv(config)[_argv(config).index("--no-webui") + 1:] for config in ls.CONFIGS}
    assert tail["plain"] == []
    assert tail["ngram-simple"] == ["--spec-type", "ngram-simple"]
    assert tail["spec-default"] == ["--spec-default"]
    assert tail["draft-simple"] == ["--spec-type", "draft-simple", "-md", "/m/draft.gguf", "--spec-draft-n-max", "3",
                                    "-td", "2", "-tbd", "2"]
    assert "/m/draft.gguf" not in _argv("plain")  # only draft-simple loads the draft


def test_the_context_is_sized_as_serve_sizes_it() -> None:
    """Asked for: kept (at most the model's) when the slots fit, else refused; not asked for: what fits
    the slots in KV_SHARE of the free memory, at most the model's, in whole CONTEXT_STEPs."""
    token = 1000  # bytes per token of context
    room = 16 * 4096 * token
    free = int(room / ls.KV_SHARE) + 1
    assert ls.fit_context(2048, 16, 8192, token, free) == 2048
    assert ls.fit_context(99_999, 1, 8192, token, None) == 8192  # at most the model's; nothing to check
    with pytest.raises(SettingError, match="16 slots x 8192 tokens needs .* lower --peer-slots or --peer-context"):
        ls.fit_context(8192, 16, 8192, token, free)
    assert ls.fit_context(None, 16, 32768, token, free) == 4096
    assert ls.fit_context(None, 16, 32768, token, free + int(300 * 16 * token / ls.KV_SHARE)) == 4352  # steps of 256
    assert ls.fit_context(None, 16, 2048, token, free) == 2048  # the model's, where it fits
    assert ls.fit_context(None, 16, 32768, token, None) == 32768
    with pytest.raises(SettingError, match="16 slots of at least 512 tokens .* lower --peer-slots"):
        ls.fit_context(None, 16, 32768, token, 16 * 300 * token)


def test_a_plan_sizes_the_kv_caches_of_target_and_draft(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    per_token = ls.kv_bytes_per_token("smollm2-135m")
    assert per_token == 2 * 30 * 3 * 64 * 2  # SmolLM2-135M: 30 layers, 3 KV heads of 64, f16
    _fake_server(tmp_path, tmp_path / "seen.jsonl")
    monkeypatch.setenv(peers.ENV_DIR, str(tmp_path))
    both = ls.PeerSettings(slots=4, model="smollm2-135m", draft="smollm2-135m", threads=1)
    free = int(4 * 1024 * per_token * 2 / ls.KV_SHARE) + 1  # 4 slots of 1024 tokens, target and draft
    plan = ls.plan(both, free=free)
    assert (plan.context, plan.threads, plan.server) == (1024, 1, tmp_path / "bin" / ls.TOOL)
    assert plan.draft is not None and plan.draft.name == plan.target.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    alone = ls.plan(ls.PeerSettings(slots=4, model="smollm2-135m", configs=("plain",), threads=1), free=free)
    assert (alone.context, alone.draft) == (2048, None)  # no draft model: twice the context fits


# ---------------------------------------------------------------------- the process
FAKE_SERVER = textwrap.dedent('''\
    #!{python}
    """A stand-in for llama-server: /health, /v1/models and streamed chat completions."""
    import json, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    argv = sys.argv[1:]
    if "--exit-at-once" in argv or {exit_at_once}:
        print("error: cannot load the model", flush=True)
        sys.exit(3)
    port = int(argv[argv.index("--port") + 1])
    started = time.monotonic()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _json(self, code, body):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                loading = time.monotonic() - started < 0.3
                self._json(503 if loading else 200, {{"status": "loading model" if loading else "ok"}})
            elif self.path == "/v1/models":
                self._json(200, {{"data": [{{"id": "target.gguf"}}]}})
            else:
                self._json(404, {{"error": {{"message": "no such path"}}}})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with open({seen!r}, "a") as f:
                f.write(json.dumps(body) + "\\n")
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            n = body["max_tokens"]
            for i in range(n):
                chunk = {{"choices": [{{"delta": {{"content": "x"}}, "index": 0}}]}}
                self.wfile.write(("data: " + json.dumps(chunk) + "\\n\\n").encode())
            usage = {{"choices": [], "usage": {{"completion_tokens": n, "prompt_tokens": 5}}}}
            self.wfile.write(("data: " + json.dumps(usage) + "\\n\\ndata: [DONE]\\n\\n").encode())

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
''')


def _fake_server(directory: Path, seen: Path, exit_at_once: bool = False) -> Path:
    """``directory/bin/llama-server``: the fake above, executable."""
    path = directory / "bin" / ls.TOOL
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(FAKE_SERVER.format(python=sys.executable, seen=str(seen), exit_at_once=exit_at_once))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie is gone too: Popen.wait reaped it, so it would not be there
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def test_running_waits_for_health_and_stops_the_server_even_on_error(tmp_path: Path) -> None:
    server = _fake_server(tmp_path, tmp_path / "seen.jsonl")
    port = ls.free_port()
    pids = []
    with pytest.raises(KeyboardInterrupt):
        with ls.running([str(server), "--port", str(port)], port) as url:
            health = httpx.get(f"{url}/health")
            assert health.status_code == 200 and health.json() == {"status": "ok"}
            pids += [int(p) for p in os.listdir("/proc") if p.isdigit() and _cmdline(int(p)).endswith(f"{port}")]
            raise KeyboardInterrupt  # Ctrl-C while measuring
    assert pids and all(_gone(pid) for pid in pids)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def test_a_server_that_exits_while_starting_is_an_error_with_its_log(tmp_path: Path) -> None:
    server = _fake_server(tmp_path, tmp_path / "seen.jsonl", exit_at_once=True)
    port = ls.free_port()
    with pytest.raises(RemoteError, match="llama-server exited with status 3 while starting: error: cannot load"):
        with ls.running([str(server), "--port", str(port)], port):
            pass


def test_a_server_that_dies_while_measured_is_named_with_its_log(tmp_path: Path) -> None:
    server = _fake_server(tmp_path, tmp_path / "seen.jsonl")
    port = ls.free_port()
    with pytest.raises(RemoteError, match=r"request 0 failed; llama-server exited with status -9"):
        with ls.running([str(server), "--port", str(port)], port):
            pid = next(int(p) for p in os.listdir("/proc") if p.isdigit() and _cmdline(int(p)).endswith(f"{port}"))
            os.kill(pid, signal.SIGKILL)
            while _alive(pid):
                time.sleep(0.05)
            raise RemoteError("request 0 failed")  # what the client says of a server gone


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


# ---------------------------------------------------------------------- the plain client
def _request(index: int) -> StreamRequest:
    return StreamRequest(index, "code", Prompt(id=f"code/{index}", messages=(("user", "def f():"),)))


def test_the_plain_client_sends_openai_requests_without_our_extension() -> None:
    sent: list[dict[str, Any]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        stream = ('data: {"choices": [{"delta": {"role": "assistant"}}]}\n\n'
                  'data: {"choices": [{"delta": {"content": "ab"}}]}\n\n'
                  'data: {"choices": [], "usage": {"completion_tokens": 7}}\n\ndata: [DONE]\n\n')
        return httpx.Response(200, text=stream, headers={"content-type": "text/event-stream"})

    settings = ReplaySettings(url="http://peer:1", max_tokens=12)
    with PlainClient(settings, transport=httpx.MockTransport(answer)) as client:
        record = client.chat("target.gguf", _request(0), PEER_MODE)
    assert record.completion_tokens == 7 and record.ttft_s >= 0
    (body,) = sent
    assert "autotune" not in body and body["temperature"] == 0 and body["max_tokens"] == 12 and body["stream"]
    assert body["messages"] == [{"role": "user", "content": "def f():"}]


def test_the_stream_reads_the_prompt_tokens_where_the_usage_has_them() -> None:
    done = "data: [DONE]"
    both = read_stream(['data: {"choices": [], "usage": {"completion_tokens": 3, "prompt_tokens": 9}}', done], 0.0, "r")
    assert (both.completion_tokens, both.prompt_tokens) == (3, 9)
    assert read_stream(['data: {"choices": [], "usage": {"completion_tokens": 3}}', done], 0.0, "r").prompt_tokens is None


def test_a_stream_without_usage_or_an_http_error_is_a_remote_error() -> None:
    with pytest.raises(RemoteError, match="without usage.completion_tokens"):
        read_stream(['data: {"choices": []}', "data: [DONE]"], 0.0, "request 0")
    transport = httpx.MockTransport(lambda r: httpx.Response(400, json={"error": {"message": "too long"}}))
    with PlainClient(ReplaySettings(url="http://peer:1"), transport=transport) as client:
        with pytest.raises(RemoteError, match="answered HTTP 400: too long"):
            client.chat("m", _request(3), PEER_MODE)


# ---------------------------------------------------------------------- comparison against peers
def _point(server: str, mode: str, concurrency: int, rounds: tuple[float, ...]) -> LoadPoint:
    tokens = 100 * len(rounds)
    wall = sum(100 / r for r in rounds)
    return LoadPoint(server=server, mode=mode, concurrency=concurrency, requests=len(rounds), tokens=tokens,
                     wall_s=wall, tokens_per_s=tokens / wall, requests_per_s=len(rounds) / wall, latency_p50_s=1.0,
                     latency_p95_s=1.0, ttft_p50_s=0.1, mean_batch=None, rows_per_step=None, rounds=len(rounds),
                     round_tokens_per_s=rounds)


def test_auto_is_set_against_the_best_peer_at_each_concurrency() -> None:
    """The best peer configuration by pooled tok/s at each concurrency, whichever it is there; the
    peers' rounds ran apart from ours, so the interval is Welch's on the logarithms."""
    e = math.exp(0.1)
    points = [
        _point("ours", "plain", 1, (8.0, 8.0)), _point("ours", "auto", 1, (12.0 * e, 12.0 / e)),
        _point("ours", "plain", 4, (15.0, 15.0)), _point("ours", "auto", 4, (20.0, 20.0)),
        _point("llama-server:plain", PEER_MODE, 1, (9.0, 9.0)),
        _point("llama-server:ngram-simple", PEER_MODE, 1, (10.0 * e, 10.0 / e)),
        _point("llama-server:plain", PEER_MODE, 4, (25.0, 25.0)),
        _point("llama-server:ngram-simple", PEER_MODE, 4, (16.0, 16.0)),
        _point("llama-server:plain", PEER_MODE, 16, (30.0,)),  # ours did not measure 16 clients: nothing
    ]
    within1, within4, peer1, peer4 = compare(points)
    assert (within1.against, within4.against, within1.paired) == ("plain", "plain", True)  # peers not among modes
    assert (peer1.against, peer4.against) == ("llama-server:ngram-simple", "llama-server:plain")
    assert not peer1.paired and peer1.server == "ours" and peer1.mode == "auto"
    assert peer1.ratio == pytest.approx(points[1].tokens_per_s / points[5].tokens_per_s)
    # both sets' logs are +-0.1 around log 12 and log 10: difference log 1.2, variance 0.02/2 each
    half = 4.303 * math.sqrt(0.01 + 0.01)  # Welch's df = 2 here: t(0.975, 2) = 4.303
    assert peer1.low == pytest.approx(1.2 * math.exp(-half), rel=1e-3)
    assert peer1.high == pytest.approx(1.2 * math.exp(half), rel=1e-3)
    assert (peer4.ratio, peer4.low, peer4.high) == (pytest.approx(0.8), pytest.approx(0.8), pytest.approx(0.8))
    table = format_comparisons([peer1, peer4])
    assert "| ours | 4 | auto | llama-server:plain | 0.800 | 0.800 / 0.800 | 0.800 - 0.800 (unpaired) |" in table
    assert compare([p for p in points if p.mode == PEER_MODE]) == []  # peers alone: nothing of ours to compare


def test_the_load_plot_draws_the_comparison_panel(tmp_path: Path) -> None:
    from autotune.reports.load_plots import load_plot

    points = [_point("ours", "auto", 1, (12.0, 11.0)), _point("ours", "plain", 1, (8.0, 8.5)),
              _point("llama-server:plain", PEER_MODE, 1, (9.0, 9.5))]
    with_ratios = load_plot(points, tmp_path / "load.png", compare(points))
    alone = load_plot(points, tmp_path / "alone.png")
    assert with_ratios.stat().st_size > alone.stat().st_size > 5_000


# ---------------------------------------------------------------------- the command
@pytest.fixture
def quiet_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    import autotune.cli.main

    monkeypatch.setattr(autotune.cli.main, "_quiet_libraries", lambda: None)


def test_an_unknown_config_is_a_one_line_error(capsys: pytest.CaptureFixture[str], quiet_cli: None) -> None:
    code, _, err = run(capsys, "loadtest", "--peer", "llama-server:plain,fast", "--stream", "mixed")
    assert_one_line_error(code, err, "unknown llama-server configuration 'fast'",
                          "configurations: plain, ngram-simple, spec-default, draft-simple")


def test_an_unbuilt_llama_server_is_a_one_line_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str], quiet_cli: None) -> None:
    monkeypatch.setenv(peers.ENV_DIR, str(tmp_path))
    code, _, err = run(capsys, "loadtest", "--peer", "llama-server:plain", "--peer-model", "smollm2-135m",
                       "--peer-context", "512", "--stream", "mixed", "--concurrency", "1")
    assert_one_line_error(code, err, f"llama-server not found at {tmp_path}/bin/llama-server: build it with "
                                     "`make peers`")


def test_nothing_to_measure_is_a_one_line_error(capsys: pytest.CaptureFixture[str], quiet_cli: None) -> None:
    code, _, err = run(capsys, "loadtest", "--stream", "mixed")
    assert_one_line_error(code, err, "nothing to measure: pass --url")


def test_loadtest_measures_each_peer_config_with_plain_requests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str],
                                                               quiet_cli: None) -> None:
    """End to end with the fake server: one process per configuration, one after the other, each a
    server of its own in the one peer mode; nothing left running; the peer described in the JSON."""
    seen = tmp_path / "seen.jsonl"
    _fake_server(tmp_path, seen)
    monkeypatch.setenv(peers.ENV_DIR, str(tmp_path))
    out = tmp_path / "load.json"
    code, stdout, err = run(capsys, "loadtest", "--peer", "llama-server:plain,ngram-simple", "--peer-model",
                            "smollm2-135m", "--peer-context", "512", "--peer-slots", "2", "--peer-threads", "1",
                            "--stream", "mixed", "--concurrency", "1,2", "--min-requests", "2", "--warmup", "0",
                            "--max-tokens", "5", "--json", str(out), "--plot", str(tmp_path / "load.png"))
    assert code == 0, err
    report = json.loads(out.read_text())
    assert [(p["server"], p["mode"], p["concurrency"]) for p in report["points"]] == [
        ("llama-server:plain", "peer", 1), ("llama-server:plain", "peer", 2),
        ("llama-server:ngram-simple", "peer", 1), ("llama-server:ngram-simple", "peer", 2)]
    assert all(p["tokens"] == 5 * p["requests"] for p in report["points"])
    peer = report["config"]["peer"]
    assert (peer["slots"], peer["threads"], peer["request_context"], peer["draft"]) == (2, 1, 512, None)
    bodies = [json.loads(line) for line in seen.read_text().splitlines()]
    assert len(bodies) == 2 * (2 + 4) and not any("autotune" in b for b in bodies)  # 2 + 4 requests a config
    assert "llama-server:ngram-simple | peer | 2 |" in stdout
    assert not [p for p in os.listdir("/proc") if p.isdigit() and str(tmp_path / "bin") in _cmdline(int(p))]


# ---------------------------------------------------------------------- the real llama-server
def _server_built() -> bool:
    try:
        ls.find_server()
    except MethodError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.heavy  # a load test against an outside server process (llama-server), where `make peers` built it
@pytest.mark.skipif(not _server_built(), reason=f"llama-server is not built (no {ls.TOOL} under "
                                                f"{peers.llamacpp_dir()}): run `make peers`")
def test_loadtest_measures_the_real_llama_server(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "load.json"
    code, stdout, err = run(capsys, "loadtest", "--peer", "llama-server:plain", "--peer-model", "smollm2-135m",
                            "--peer-slots", "1", "--peer-context", "2048", "--stream", "mixed", "--concurrency", "1",
                            "--min-requests", "2", "--requests-per-client", "1", "--warmup", "0",
                            "--max-tokens", "8", "--json", str(out))
    assert code == 0, err
    (point,) = json.loads(out.read_text())["points"]
    assert (point["server"], point["mode"], point["requests"]) == ("llama-server:plain", "peer", 2)
    assert 0 < point["tokens"] <= 16 and point["tokens_per_s"] > 0 and point["ttft_p50_s"] > 0
    assert "llama-server:plain | peer | 1 | 2 |" in stdout
