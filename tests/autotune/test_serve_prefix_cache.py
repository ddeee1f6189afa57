"""Prefix caching across requests in `autotune serve`, over HTTP with the official `openai` client
(real SmolLM2, slow tier): a chat's second turn reuses the rows of its first turn (prompt and answer),
every response is token for token what the server answers without the cache, in three modes, and a
cache that serves a stale block is caught. The figures show up in the usage object, ``/health``
and ``/metrics``; ``POST /reset_prefix_cache`` empties the cache."""
from __future__ import annotations

import httpx
import pytest

from autotune.serving.server import ServeConfig, build_server
from autotune.store.records import ResultMetrics
from autotune.store.resolve import strategy_key
from autotune.store.storage import open_storage
from runtime.prefix_cache import PrefixCache
from search_spaces.strategy import Strategy
from studies import load_prompts, routing_text
from tests.helpers import MAX_TOKENS, MODEL, LiveServer, StaleCache, settled

# heavy: servers over HTTP (about 2.5 minutes); the cache's exactness stays in the default run on tiny models
# in every decoding mode (tests/runtime/test_prefix_cache.py)
pytestmark = [pytest.mark.slow, pytest.mark.heavy]
MODES = ("plain", "default", "auto")
FIRST = ("Write a Python function that returns the squares of a list of numbers.",
         "What is the capital of France, and why is it famous?")
SECOND = "Now explain your answer in one short sentence."


@pytest.fixture(scope="module")
def store(smollm, tmp_path_factory):
    url = f"sqlite:///{tmp_path_factory.mktemp('prefix') / 'store.db'}"
    with open_storage(url) as storage:
        texts = [routing_text(p) for p in load_prompts("humaneval", None, 12)]
        storage.record(strategy_key(smollm, None, "humaneval", "cpu"), Strategy(drafter="prompt-lookup", draft_length=6),
                       ResultMetrics.from_throughput(20.0), prompts=texts)
    return url


def _server(pool, url: str, gib: float | None, cache: PrefixCache | None = None):
    storage = open_storage(url)
    server = build_server(ServeConfig(model=MODEL, storage=url, prefix_cache_gib=gib), storage, pool=pool)
    if cache is not None:  # a deliberately wrong cache in its place (the power check)
        server.worker.decoders.prefix = cache
    return server, storage


def _conversations(live: LiveServer, modes: tuple[str, ...] = MODES, **extra) -> list[tuple[list[int], int]]:
    """Two-turn chats in each mode: (turn 2's token ids, its cached prompt tokens) each."""
    client = live.client()
    out = []
    for mode in modes:
        for question in FIRST:
            messages = [{"role": "user", "content": question}]
            body = dict(model=MODEL, max_tokens=MAX_TOKENS, temperature=0)
            opts = {"autotune": {"strategy": mode, "return_token_ids": True}, **extra}
            first = client.chat.completions.create(messages=messages, extra_body=opts, **body)
            messages += [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": SECOND}]
            second = client.chat.completions.create(messages=messages, extra_body=opts, **body)
            info = second.model_extra["autotune"]
            assert second.usage.prompt_tokens_details.cached_tokens == info["prefix_tokens"]
            out.append((info["token_ids"], info["prefix_tokens"]))
    return out


def _first_turn_cached(live: LiveServer) -> int:
    """The first conversation's first turn sent again: its prompt tokens that came from the cache."""
    response = live.client().chat.completions.create(
        model=MODEL, max_tokens=MAX_TOKENS, temperature=0, messages=[{"role": "user", "content": FIRST[0]}],
        extra_body={"autotune": {"strategy": "default", "return_token_ids": True}})
    return response.model_extra["autotune"]["prefix_tokens"]


@pytest.fixture(scope="module")
def without_cache(pool, store):
    server, storage = _server(pool, store, 0.0)
    assert server.worker.decoders.prefix is None and "no prefix cache" in server.sizing.describe()
    with LiveServer(server) as live:
        answers = _conversations(live)
    storage.close()
    return answers


def test_every_response_is_the_same_with_the_cache_and_turn_two_reuses_turn_one(pool, store, without_cache):
    server, storage = _server(pool, store, None)  # the default budget
    with LiveServer(server) as live:
        got = _conversations(live)
        settled(server)
        health = httpx.get(f"{live.url}/health").json()
        metrics = httpx.get(f"{live.url}/metrics").text
        opted_out = _conversations(live, ("plain",), cache_prompt=False)
        again = _first_turn_cached(live)  # its rows were kept by the conversations
        reset = httpx.post(f"{live.url}/reset_prefix_cache").json()
        emptied = httpx.get(f"{live.url}/health").json()["prefix_cache"]
        after = _first_turn_cached(live)  # a load test's next pass: nothing of the earlier ones
    storage.close()
    assert again > 0 and after == 0
    assert reset["prefix_cache"] and reset["freed_bytes"] > 0 and emptied["used_bytes"] == 0 == emptied["blocks"]
    assert [ids for ids, _ in got] == [ids for ids, _ in without_cache]  # token for token, every mode
    assert all(n > 0 for _, n in got) and all(n == 0 for _, n in without_cache)
    assert all(n == 0 for _, n in opted_out) and [i for i, _ in opted_out] == [i for i, _ in without_cache[:len(FIRST)]]
    cache = health["prefix_cache"]
    assert 0 < cache["used_bytes"] <= cache["budget_bytes"] and cache["tokens_reused"] >= sum(n for _, n in got)
    assert 0 < cache["hit_rate"] <= 1
    assert "autotune:prefix_cache_tokens_reused_total" in metrics and "autotune:prefix_cache_hit_rate" in metrics


def test_a_cache_that_serves_a_stale_block_is_caught(pool, store, without_cache):
    server, storage = _server(pool, store, None, StaleCache(2**30))
    with LiveServer(server) as live:
        got = _conversations(live, ("plain",))
    storage.close()
    assert [ids for ids, _ in got] != [ids for ids, _ in without_cache[:len(FIRST)]]
