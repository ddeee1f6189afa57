"""Helpers shared by several test modules (fixtures live in the ``conftest.py`` files).

Tests import helpers from here (or from ``runtime.testing``: ``tiny_model``, ``noisy_copy``), never
from a ``conftest.py`` or from another ``test_*`` module (``tests/test_layout.py`` checks it).
What only some helpers need (the CLI, the server, the data sets) is imported inside them.
"""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from autotune.store.hardware import hardware_fingerprint
from autotune.store.records import StrategyKey
from search_spaces.layer_plan import LayerPlan
from search_spaces.strategy import PLAIN, SWIFT_DYNAMIC_WIDTHS, Strategy


# ---------------------------------------------------------------------- the CLI
def run(capsys, *argv: str) -> tuple[int, str, str]:
    """Run ``autotune`` in this process: (exit status, stdout, stderr)."""
    from autotune.cli.main import main

    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse usage errors
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """Run ``python -m autotune.cli`` in a child process (text output captured)."""
    return subprocess.run(
        [sys.executable, "-m", "autotune.cli", *args], capture_output=True, text=True, timeout=600
    )


def assert_one_line_error(code: int, err: str, *needles: str, progress_bars: bool = False) -> None:
    """Exit status 2, no traceback and one non-blank line on stderr that holds every needle.

    ``progress_bars``: leave tqdm bars out of the count (e.g. a child process's first dequantisation
    of a model into the cache)."""
    import re

    lines = [line for line in err.splitlines() if line.strip()]
    if progress_bars:
        lines = [line for line in lines if not re.search(r"\d+%\|.*\|", line)]
    assert code == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]


# ---------------------------------------------------------------------- a store of tuned strategies
# what the ``url`` fixture (tests/autotune/conftest.py) stores: `autotune strategies` and `study`
STORED_MODEL = "smollm2-135m@gguf:b179c9523d0e"
HW = hardware_fingerprint("cpu")
STORED = {  # name -> (draft, task, strategy); ids follow this order
    "draft": ("smollm2-135m", "humaneval", Strategy(draft_length=6, draft_vocab=32768, confidence_threshold=0.5)),
    "lookup": ("", "gsm8k", Strategy(drafter="prompt-lookup", draft_length=7)),
    "selfskip": ("", "mt-bench", Strategy(drafter="layer-skip", layer_plan=LayerPlan(n_layers=30, skip_attn=(5, 6)))),
    "tree": ("smollm2-135m", "gsm8k", Strategy(draft_length=3, tree_widths=(2, 2, 1))),
    "groups": ("smollm2-135m", "mt-bench", Strategy(layer_plan=LayerPlan(n_layers=30, groups=((1, 3),)))),
    "plain": ("", "humaneval", PLAIN),
    "dynamic": ("smollm2-135m", "prompts", Strategy(dynamic_widths=SWIFT_DYNAMIC_WIDTHS)),
}
IDS = {name: i + 1 for i, name in enumerate(STORED)}


def stored_key(draft: str, task: str) -> StrategyKey:
    return StrategyKey(STORED_MODEL, "b179c9523d0e", draft, task, HW)


def snapshot(url: str) -> tuple:
    """The store's best rows and their history lengths: equal before and after => untouched."""
    from autotune.store.storage import open_storage

    with open_storage(url) as storage:
        rows = storage.list_best()
        return tuple((r.id, r.score, r.strategy_json) for r in rows), tuple(len(storage.history(r.key)) for r in rows)


# ---------------------------------------------------------------------- `autotune serve` on loopback
MODEL = "smollm2-135m"  # the served model
MAX_TOKENS = 24


def routing_texts(task: str, n: int = 15, offset: int = 0) -> list[str]:
    """The routing texts of ``n`` prompts of ``task`` from ``offset`` on."""
    from studies import load_prompts, routing_text

    return [routing_text(p) for p in load_prompts(task, None, n, offset)]


class LiveServer:
    """uvicorn serving the app in a thread, on a free loopback port."""

    def __init__(self, server, refresh_s: float = 3600.0) -> None:
        import uvicorn

        from autotune.serving.server import make_app

        self.server = server
        self.uv = uvicorn.Server(uvicorn.Config(make_app(server, refresh_s), host="127.0.0.1", port=0,
                                                log_level="warning"))
        self.thread = threading.Thread(target=self.uv.run, daemon=True)

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.time() + 60
        while not self.uv.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.05)
        port = self.uv.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc) -> None:
        self.uv.should_exit = True
        self.thread.join(30)

    def client(self):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=300)


def settled(server, timeout_s: float = 30.0) -> None:
    """Wait until the decode worker's bookkeeping after the last answer is done (its rows in the
    prefix cache, its route judged): what ``/health`` and the adaptive layer show trails the answer."""
    deadline = time.time() + timeout_s
    while server.worker.loop.leaving:
        assert time.time() < deadline, "the decode worker did not settle after its last answer"
        time.sleep(0.01)


def chat(client, text: str, strategy: str = "auto", stream: bool = False, max_tokens: int = MAX_TOKENS,
         cache_prompt: bool = True, **kw):
    """-> (text, completion token ids, the autotune object) of one greedy chat request (``cache_prompt``
    False: it neither reuses nor leaves prefix-cache rows)."""
    body = dict(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=max_tokens, temperature=0,
                extra_body={"autotune": {"strategy": strategy, "return_token_ids": True}, "cache_prompt": cache_prompt},
                **kw)
    if not stream:
        r = client.chat.completions.create(**body)
        text, usage, info = r.choices[0].message.content, r.usage, r.model_extra["autotune"]
    else:
        parts, final = [], None
        for chunk in client.chat.completions.create(stream=True, **body):
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
            if chunk.model_extra.get("autotune"):
                final = chunk
        text, usage, info = "".join(parts), final.usage, final.model_extra["autotune"]
    assert usage.completion_tokens == len(info["token_ids"])
    return text, info["token_ids"], info


# unknown traffic of one kind: far from code, homogeneous enough to route to its own centroid
TRANSLATE = [f"Translate this sentence into French, keeping its tone: {s}" for s in (
    "The weather was lovely for a walk along the river this morning.",
    "My grandmother keeps a small garden full of tomatoes and roses.",
    "Our train was delayed by an hour because of the snow.",
    "The museum opens late on Fridays, so we went after dinner.",
    "He finally learned to bake bread without burning the crust.",
    "The children laughed at the puppet show in the park.",
    "She writes letters to her old friends every winter.",
    "We watched the sunset from the top of the hill.",
    "The library is quiet except for the sound of pages turning.",
)]


def metric(url: str, name: str) -> float:
    """The sum of a Prometheus metric's samples (every label set) on a live server's /metrics."""
    import httpx

    lines = httpx.get(f"{url}/metrics").text.splitlines()
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines if ln.startswith((name + "{", name + " ")))


# ---------------------------------------------------------------------- host reads (tests/runtime)
CONVERSIONS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__")  # device -> Python


class Counter:
    def __init__(self) -> None:
        self.on = False
        self.reads = 0


@contextmanager
def counting(counter: Counter) -> Iterator[None]:
    originals = {name: getattr(torch.Tensor, name) for name in CONVERSIONS}

    def counted(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if counter.on:
                counter.reads += 1
            return fn(self, *args, **kwargs)

        return wrapper

    for name, fn in originals.items():
        setattr(torch.Tensor, name, counted(fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)


from runtime.prefix_cache import PrefixCache  # noqa: E402


class StaleCache(PrefixCache):
    """A deliberately wrong cache: it matches a block by its position alone, so a prompt that differs
    from an earlier one inside a block gets the earlier one's rows."""

    def reuse(self, lm, tokens, cache, chunk, limit, counted=True):  # type: ignore[no-untyped-def]
        with self._lock:
            trie = self._trie(lm, chunk)
            node, n = trie.root, 0
            while node.children and (n + trie.granularity) <= limit:
                node = next(iter(node.children.values()))
                assert node.keys is not None and node.values is not None
                cache.all_keys[:, :, n : n + trie.granularity] = node.keys
                cache.all_values[:, :, n : n + trie.granularity] = node.values
                n += trie.granularity
            cache.length = max(cache.length, n)
            return n
