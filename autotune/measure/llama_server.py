"""llama-server as a ``loadtest`` peer: ``--peer llama-server[:CONFIG[,CONFIG...]]``.

Each configuration (``CONFIGS``) is one llama-server process on the very GGUF files our model
aliases are built from (``peers.gguf_file``), started on a free port, waited for until its
``/health`` says ok, measured as a server of its own (labelled ``llama-server:CONFIG``) and stopped
before the next one starts, so two llama-servers never share the cores. The process is stopped on
every way out (an error, Ctrl-C), and it is started with a parent-death signal, so it cannot outlive
the load test even when that is killed.

Its threads, slots and context mirror our ``serve``: ``threads`` (default: torch's thread count, the
one our server decodes with), ``slots`` (``-np``; the CLI's default is serve's ``--max-batch``
default) and ``request_context``, the tokens one request may hold (serve's ``--max-context``), so
llama-server gets ``-c slots x request_context`` (with ``-np`` set, each slot holds ``c / np``).
Its KV caches (f16, every slot, the draft model's too where a configuration drafts with it) are
allocated at start-up, so the context is sized once, before the first start, by serve's rule
(:func:`fit_context`): without ``request_context``, what fits ``slots`` requests in ``KV_SHARE`` of
the memory free now, at most the model's context, in whole ``CONTEXT_STEP`` s; one asked for that
does not fit is refused. Every configuration then runs with the same context.

Requests are plain OpenAI chat completions (``openai_client``), greedy (temperature 0): llama-server
speaks no ``autotune`` extension, so each configuration is measured as one mode (``PEER_MODE``).
Built by ``make peers``.
"""
from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.errors import MethodError, RemoteError, SettingError
from autotune.measure import peers
from autotune.tuning.study import DEFAULT_DRAFT, DEFAULT_MODEL
from runtime.machine import available_memory

TOOL = "llama-server"
HOST = "127.0.0.1"
START_TIMEOUT_S = 600.0  # model load and warm-up on a shared 2-core machine
STOP_TIMEOUT_S = 15.0  # after SIGTERM, before SIGKILL
POLL_S = 0.25
DRAFT_N_MAX = 3  # draft-simple: llama-server's own default n-max, written out
KV_BYTES = 2  # llama-server's default KV cache type is f16
KV_SHARE = 0.8  # of the memory free now, what the peer's KV caches may take (serve's share)
CONTEXT_STEP = 256  # a context sized to fit is a whole number of these (as serve's)
MIN_CONTEXT = 512  # a context sized to fit below this is refused
GIB = 2**30


# ---------------------------------------------------------------------- configurations
@dataclass(frozen=True)
class ServerConfig:
    """One way to run llama-server: its speculation flags (``flags(draft GGUF, threads)``)."""

    name: str
    describe: str
    flags: Callable[[str | None, int], list[str]]
    needs_draft: bool = False


def _draft_flags(draft: str | None, threads: int) -> list[str]:
    assert draft is not None
    return ["--spec-type", "draft-simple", "-md", draft, "--spec-draft-n-max", str(DRAFT_N_MAX),
            "-td", str(threads), "-tbd", str(threads)]


CONFIGS: dict[str, ServerConfig] = {
    "plain": ServerConfig("plain", "no speculation (llama-server's default)", lambda draft, threads: []),
    "ngram-simple": ServerConfig(
        "ngram-simple", "prompt lookup, llama.cpp's ngram-simple at its defaults (n 12, m 48)",
        lambda draft, threads: ["--spec-type", "ngram-simple"]),
    "spec-default": ServerConfig(
        "spec-default", "llama.cpp's --spec-default (ngram-mod: n-match 24, n-min 48, n-max 64)",
        lambda draft, threads: ["--spec-default"]),
    "draft-simple": ServerConfig(
        "draft-simple", f"the draft GGUF (-md), draft-simple, n-max {DRAFT_N_MAX}", _draft_flags, needs_draft=True),
}


def parse_peer(text: str) -> tuple[str, ...]:
    """``llama-server[:CONFIG[,CONFIG...]]`` -> the configurations, in order (all of ``CONFIGS``
    when none is named)."""
    tool, sep, rest = text.strip().partition(":")
    if tool != TOOL:
        raise MethodError(f"unknown peer {tool!r} in --peer {text!r}; peers: {TOOL}[:CONFIG,...]")
    names = tuple(n.strip() for n in rest.split(",") if n.strip()) if sep else tuple(CONFIGS)
    if not names:
        raise MethodError(f"--peer {text!r} names no configuration; configurations: {', '.join(CONFIGS)}")
    for name in names:
        if name not in CONFIGS:
            raise MethodError(f"unknown {TOOL} configuration {name!r}; configurations: {', '.join(CONFIGS)}")
    repeated = [n for i, n in enumerate(names) if n in names[:i]]
    if repeated:
        raise MethodError(f"{TOOL} configuration {repeated[0]!r} is listed twice in --peer; list each once")
    return names


def label(config: str) -> str:
    """The server label a configuration's points carry: ``llama-server:CONFIG``."""
    return f"{TOOL}:{config}"


# ---------------------------------------------------------------------- settings
@dataclass(frozen=True)
class PeerSettings:
    """How every llama-server configuration runs: which GGUF files, threads, slots and context."""

    slots: int  # -np: requests decoded side by side (the CLI's default: serve's --max-batch default)
    model: str = DEFAULT_MODEL  # a packaged GGUF alias: the target
    draft: str = DEFAULT_DRAFT  # a packaged GGUF alias: draft-simple's draft
    threads: int | None = None  # -t / -tb (and -td / -tbd); None: torch's thread count, as our server's
    request_context: int | None = None  # prompt + completion tokens of one request; None: what fits (fit_context)
    configs: tuple[str, ...] = tuple(CONFIGS)

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise SettingError(f"--peer-slots must be at least 1, got {self.slots}")
        if self.threads is not None and self.threads < 1:
            raise SettingError(f"--peer-threads must be at least 1, got {self.threads}")
        if self.request_context is not None and self.request_context < 2:
            raise SettingError(f"--peer-context must be at least 2 tokens, got {self.request_context}")
        for name in self.configs:
            if name not in CONFIGS:
                raise MethodError(f"unknown {TOOL} configuration {name!r}; configurations: {', '.join(CONFIGS)}")

    @property
    def needs_draft(self) -> bool:
        return any(CONFIGS[name].needs_draft for name in self.configs)


def thread_count(settings: PeerSettings) -> int:
    if settings.threads is not None:
        return settings.threads
    import torch

    return torch.get_num_threads()


def kv_bytes_per_token(alias: str) -> int:
    """llama-server's KV cache bytes per token of context for ``alias`` (f16 keys and values, every layer)."""
    from runtime.loading import model_config

    config = model_config(alias)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * KV_BYTES


def fit_context(asked: int | None, slots: int, model_context: int, token_bytes: int, free: int | None) -> int:
    """One request's context: as ``asked`` (at most the model's) when ``slots`` of it fit in
    ``KV_SHARE`` of ``free`` bytes, else an error; without ``asked``, what fits, at most the model's,
    in whole ``CONTEXT_STEP`` s (at least ``MIN_CONTEXT``)."""
    room = None if free is None else int(free * KV_SHARE)
    if asked is not None:
        context = min(asked, model_context)
        need = slots * context * token_bytes
        if room is not None and need > room:
            raise SettingError(
                f"{TOOL}: {slots} slots x {context} tokens needs {need / GIB:.1f} GiB of KV cache and "
                f"{room / GIB:.1f} GiB is there for it; lower --peer-slots or --peer-context")
        return context
    if room is None or room // (slots * token_bytes) >= model_context:
        return model_context
    context = room // (slots * token_bytes) // CONTEXT_STEP * CONTEXT_STEP
    if context < MIN_CONTEXT:
        raise SettingError(
            f"{TOOL}: {slots} slots of at least {MIN_CONTEXT} tokens need {slots * MIN_CONTEXT * token_bytes / GIB:.1f} "
            f"GiB of KV cache and {room / GIB:.1f} GiB is there for it; lower --peer-slots")
    return context


def find_server() -> Path:
    try:
        return peers.find_tool(TOOL)
    except MethodError:
        raise MethodError(f"{TOOL} not found at {peers.llamacpp_dir() / 'bin' / TOOL}: build it with `make peers` "
                          f"(or set ${peers.ENV_DIR} to a llama.cpp directory holding bin/{TOOL})") from None


@dataclass(frozen=True)
class PeerPlan:
    """``PeerSettings`` resolved once, before anything starts: the binary, the GGUF files, the
    threads and the one context every configuration runs with."""

    settings: PeerSettings
    server: Path
    target: Path
    draft: Path | None
    threads: int
    context: int


def plan(settings: PeerSettings, free: int | None = None) -> PeerPlan:
    """Fail before anything starts: the server built, the GGUF files there, the KV caches fitting
    (``free``: bytes free now; default: ``available_memory()``)."""
    from runtime.loading import model_config

    server = find_server()
    target = peers.gguf_file(settings.model)
    draft = peers.gguf_file(settings.draft) if settings.needs_draft else None
    token_bytes = kv_bytes_per_token(settings.model) + (kv_bytes_per_token(settings.draft) if draft else 0)
    model_context = int(model_config(settings.model).max_position_embeddings)
    context = fit_context(settings.request_context, settings.slots, model_context, token_bytes,
                          available_memory() if free is None else free)
    return PeerPlan(settings, server, target, draft, thread_count(settings), context)


# ---------------------------------------------------------------------- the process
def server_argv(plan: PeerPlan, config: str, port: int) -> list[str]:
    """The command line of one configuration (greedy: the client's requests ask for temperature 0)."""
    spec, slots, threads = CONFIGS[config], plan.settings.slots, plan.threads
    return [
        str(plan.server), "-m", str(plan.target), "--host", HOST, "--port", str(port), "-t", str(threads),
        "-tb", str(threads), "-np", str(slots), "-c", str(slots * plan.context), "--no-webui",
        *spec.flags(str(plan.draft) if spec.needs_draft and plan.draft is not None else None, threads),
    ]


def free_port(host: str = HOST) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:  # pragma: no cover - runs in the child, between fork and exec
    """The child gets SIGTERM when the load test's process dies, however it dies (Linux)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _log_tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after ``STOP_TIMEOUT_S``; returns once the process is gone."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = START_TIMEOUT_S) -> None:
    """Until ``GET /health`` answers 200 ``{"status": "ok"}`` (503 while it loads); an exit or the
    time running out is an error carrying the log's last lines."""
    import httpx

    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=url, timeout=5.0) as http:
        while True:
            if proc.poll() is not None:
                raise RemoteError(f"{TOOL} exited with status {proc.returncode} while starting: {_log_tail(log)}")
            try:
                response = http.get("/health")
                if response.status_code == 200 and response.json().get("status") == "ok":
                    return
            except (httpx.HTTPError, ValueError, AttributeError):
                pass  # not listening yet, or not answering JSON yet
            if time.monotonic() > deadline:
                raise RemoteError(f"{TOOL} did not report healthy within {timeout_s:.0f} s: {_log_tail(log)}")
            time.sleep(POLL_S)


@contextlib.contextmanager
def running(argv: Sequence[str], port: int, timeout_s: float = START_TIMEOUT_S) -> Iterator[str]:
    """Start ``argv`` (its log to a temporary file), wait until healthy, yield its URL; stop it on
    every way out of the block."""
    url = f"http://{HOST}:{port}"
    with tempfile.TemporaryDirectory(prefix="autotune-llama-server-") as tmp:
        log = Path(tmp) / "server.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, preexec_fn=_die_with_parent)
        try:
            wait_healthy(url, proc, log, timeout_s)
            yield url
        except RemoteError as exc:
            if proc.poll() is None:
                raise
            raise RemoteError(f"{exc}; {TOOL} exited with status {proc.returncode}: {_log_tail(log)}") from None
        finally:
            stop(proc)


# ---------------------------------------------------------------------- what loadtest runs
@dataclass(frozen=True)
class PeerServer:
    """One configuration as ``loadtest`` measures it: a label and a way to run it."""

    label: str
    config: str
    start: Callable[[], contextlib.AbstractContextManager[str]]  # yields the URL while it runs


def peer_servers(plan: PeerPlan) -> list[PeerServer]:
    """Every configuration of the plan; each starts on a free port when measured."""
    def starter(config: str) -> Callable[[], contextlib.AbstractContextManager[str]]:
        def start() -> contextlib.AbstractContextManager[str]:
            port = free_port()
            return running(server_argv(plan, config, port), port)
        return start

    return [PeerServer(label(name), name, starter(name)) for name in plan.settings.configs]


def describe(plan: PeerPlan) -> dict[str, Any]:
    """What the load test's JSON says about the peer."""
    settings = plan.settings
    return {
        "engine": f"llama.cpp ({peers.llamacpp_version()}) {TOOL}", "gguf": [plan.target.name] + (
            [plan.draft.name] if plan.draft else []), "model": settings.model,
        "draft": settings.draft if plan.draft else None, "threads": plan.threads, "slots": settings.slots,
        "request_context": plan.context, "configs": {label(name): CONFIGS[name].describe for name in settings.configs},
    }


def terminate_on_sigterm() -> Any:
    """SIGTERM raises SystemExit in the main thread, so the ``running`` blocks stop their server
    (the previous handler is returned for restoring)."""
    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, handler)

