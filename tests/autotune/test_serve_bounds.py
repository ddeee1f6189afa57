"""Adaptive `autotune serve` kept bounded and honest (real SmolLM2, slow tier, over HTTP).

State stays bounded: a re-tune whose pending cluster was evicted goes with it; routes made from
unknown traffic stop at ``--max-routes``; strategies stored after start-up never pack a second copy
of the target (a wider one, or one the server cannot run, decodes plainly). What is stored is
earned: no request text without ``--store-prompts``, no lossy re-tune, no re-tune that measured
slower than the strategy it would replace, no overwrite of another replica's new route. Drift is
judged like with like: sampled traffic is not compared with a greedy study's acceptance. An
explicit strategy id read from a slow store holds up no other request.
"""
from __future__ import annotations

import concurrent.futures as cf
import time

import httpx
import pytest

from autotune.serving.adaptive.clusters import new_route_name
from autotune.serving.adaptive.retune import Retune
from autotune.serving.adaptive.settings import AdaptSettings
from autotune.serving.routing.terms import TERMS_PREFIX
from autotune.serving.server import ServeConfig, build_server
from autotune.store.records import ResultMetrics
from autotune.store.resolve import strategy_key
from autotune.store.storage import open_storage
from runtime.decoding import GenerationConfig
from runtime.pipeline import build_decoder, eos_ids
from search_spaces.layer_plan import uniform_skip_plan
from search_spaces.strategy import PLAIN, Strategy
from studies import Prompt, encode_prompt
from tests.helpers import MODEL, TRANSLATE, LiveServer, chat, metric, routing_texts, settled

pytestmark = pytest.mark.slow

RECIPES = [f"Suggest an easy dinner recipe with {s}, and list the steps in order." for s in (
    "chickpeas, spinach and garlic", "salmon, lemon and dill", "mushrooms, rice and thyme",
)]
POEMS = [f"Write a short poem about {s}." for s in ("a lighthouse", "the first snow", "an old bicycle")]
WEATHER = [f"What should I wear for {s} weather on a hike?" for s in ("rainy", "windy", "freezing")]
LOOKUP = Strategy(drafter="prompt-lookup", draft_length=6)


def _serve(pool, url: str, **cfg):
    storage = open_storage(url)
    return storage, LiveServer(build_server(ServeConfig(model=MODEL, storage=url, **cfg), storage, pool=pool))


def _health(live: LiveServer) -> dict:
    settled(live.server)  # the figures of the last request's route trail its answer
    r = httpx.get(f"{live.url}/health", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _plain_ids(pool, smollm, text: str, max_tokens: int) -> list[int]:
    ids = encode_prompt(Prompt(id="p", messages=(("user", text),)), smollm.tokenizer)
    cfg = GenerationConfig(max_new_tokens=max_tokens, eos_token_ids=eos_ids(smollm))
    return build_decoder(pool, smollm, PLAIN).generate(ids, cfg).tokens


def _auto_routes(storage) -> dict[str, object]:
    return {b.key.task: b for b in storage.list_best() if b.key.task.startswith("auto:")}


# ---------------------------------------------------------------------- bounded state
@pytest.mark.heavy  # a re-tune on live traffic, evicted by three more topics
def test_an_evicted_clusters_retune_is_dropped_with_it(pool, smollm, tmp_path):
    settings = AdaptSettings(new_route_requests=2, retune_requests=3, max_clusters=2)
    storage, live = _serve(pool, f"sqlite:///{tmp_path / 'store.db'}", adaptive=settings)
    with live:
        client = live.client()
        states = [chat(client, text, max_tokens=4)[2]["state"] for text in TRANSLATE[:3]]
        assert states == ["stored", "stored", "tuning"]  # the translations' cluster re-tunes
        assert _health(live)["routes"]["live_retunes"] == 1
        for text in (RECIPES[0], POEMS[0], WEATHER[0]):  # three more topics: two clusters are kept
            chat(client, text, max_tokens=4)
        health = _health(live)
        assert health["routes"]["live_retunes"] == 0, health  # evicted, its decoder and study with it
        assert len(health["routes"]["pending_clusters"]) <= 2
        assert metric(live.url, "autotune:decoders") <= 8 and metric(live.url, "autotune:verify_widths") <= 1
        assert chat(client, TRANSLATE[3], max_tokens=4)[2]["state"] == "stored"  # a fresh cluster, not tuning
    storage.close()


@pytest.mark.heavy  # 100 requests (50 topics twice), re-tuning into routes up to the cap
def test_bursts_of_distinct_topics_stay_under_the_route_cap(pool, smollm, tmp_path):
    """50 topics sharing no word, each asked twice: each would become a route; 3 do."""
    settings = AdaptSettings(new_route_requests=1, retune_requests=1, max_routes=3)
    storage, live = _serve(pool, f"sqlite:///{tmp_path / 'store.db'}", adaptive=settings)
    topics = [" ".join(f"w{i}x{j}" for j in range(4)) for i in range(50)]
    with live:
        client = live.client()
        most = 0
        for text in topics:
            for _ in range(2):
                chat(client, text, max_tokens=2)
            most = max(most, _health(live)["routes"]["live_retunes"])
        assert most <= settings.max_routes
        assert 1 <= len(_auto_routes(storage)) <= settings.max_routes
    storage.close()


@pytest.mark.parametrize("control", [
    # heavy: the same identity on a second server start-up, without request control (not the default)
    pytest.param(False, id="no-request-control", marks=pytest.mark.heavy),
    pytest.param(True, id="request-control"),
])
def test_strategies_stored_after_start_up_share_one_packed_target(pool, smollm, tmp_path, control):
    """Three wider strategies stored while the server runs: the first speculative one fixes the
    verify width (5), the wider ones decode plainly (logged), and one layer plan that cannot fit
    this model decodes plainly too, instead of failing its requests. With request control the
    width is fixed at start-up instead (9: the standby prompt lookup's k=8), so lookup k=8 fits."""
    url = f"sqlite:///{tmp_path / 'store.db'}"
    storage, live = _serve(pool, url, request_control=control)
    text = routing_texts("humaneval", 1, 0)[0]
    with live:
        client = live.client()
        assert metric(live.url, "autotune:verify_widths") == int(control)
        n = smollm.hf_model.config.num_hidden_layers
        stored = [Strategy(drafter="prompt-lookup", draft_length=k) for k in (4, 8, 12)] + [
            Strategy(drafter="layer-skip", draft_length=3, layer_plan=uniform_skip_plan(n + 10, 0.3))]
        ids = [storage.record(strategy_key(smollm, None, f"t{i}", "cpu"), s, ResultMetrics.from_throughput(10.0))
               for i, s in enumerate(stored)]
        rows = {b.history_id: b.id for b in storage.list_best()}
        expected = _plain_ids(pool, smollm, text, 24)
        infos = []
        for history_id in ids:
            _, got, info = chat(client, text, strategy=str(rows[history_id]), max_tokens=24)
            assert got == expected  # lossless whichever way it decoded
            infos.append(info)
        servable = 2 if control else 1
        assert [i["state"] for i in infos] == ["stored"] * servable + ["unservable"] * (4 - servable), infos
        assert all(i["drafted"] > 0 for i in infos[:servable]) and all(i["drafted"] == 0 for i in infos[servable:])
        assert metric(live.url, "autotune:verify_widths") == 1  # one packed copy of the target
    storage.close()


# ---------------------------------------------------------------------- what is stored
@pytest.mark.heavy  # a re-tune on live traffic into a new route
def test_no_request_text_is_stored_without_store_prompts(pool, smollm, tmp_path):
    settings = AdaptSettings(new_route_requests=3, retune_requests=2)
    storage, live = _serve(pool, f"sqlite:///{tmp_path / 'store.db'}", adaptive=settings)
    with live:
        client = live.client()
        for text in TRANSLATE[:5]:
            chat(client, text, max_tokens=8)
        [(task, best)] = _auto_routes(storage).items()
        assert task.startswith("auto:topic-")  # no words of the requests in the name either
        texts = storage.prompts(best.history_id)
        assert len(texts) == 5 and all(t.startswith(TERMS_PREFIX) for t in texts)
        assert not any(word in t.lower() for t in texts for word in ("french", "translate", "sentence"))
        # and the hashed terms still route: the next translation goes to the new route
        _, ids, info = chat(client, TRANSLATE[6], max_tokens=8)
        assert info["route"] == task and ids == _plain_ids(pool, smollm, TRANSLATE[6], 8)
    storage.close()


@pytest.mark.heavy  # a re-tune on live traffic, each on a server start-up of its own
@pytest.mark.parametrize("lossy", [True, False])
def test_a_lossy_retune_is_not_stored(pool, smollm, tmp_path, monkeypatch, lossy):
    """The re-tune's pick is forced to a draft chain (SmolLM2 drafting for itself always drafts);
    with a deliberately lossy acceptance rule its output differs from plain decoding's and nothing
    is stored; with the real rule (the power check) it is stored."""
    import runtime.decoding as decoding

    chain = Strategy(draft_length=4)
    monkeypatch.setattr(Retune, "outcome", lambda self: (chain, 1e9, 0.9, None))
    if lossy:
        real = decoding.accept_chain_greedy

        def off_by_one(target_argmax, drafts):  # the token the target appends is off by one
            result = real(target_argmax, drafts).clone()
            if len(drafts):
                at = 1 + int(result[0])
                result[at] = (result[at] + 1) % int(target_argmax.max())
            return result

        monkeypatch.setattr(decoding, "accept_chain_greedy", off_by_one)
    settings = AdaptSettings(new_route_requests=2, retune_requests=1, store_prompts=True)
    storage, live = _serve(pool, f"sqlite:///{tmp_path / 'store.db'}", draft=MODEL, adaptive=settings)
    with live:
        client = live.client()
        for text in TRANSLATE[:3]:  # two open the cluster, the third is its re-tune
            chat(client, text, strategy="auto", max_tokens=8)
        routes = _auto_routes(storage)
        if lossy:
            assert routes == {}
        else:
            assert [b.strategy for b in routes.values()] == [chain]
    storage.close()


@pytest.mark.heavy  # a re-tune on live traffic, each on a server start-up of its own
@pytest.mark.parametrize("faster", [False, True])
def test_a_retune_replaces_the_best_only_when_it_measured_as_fast(pool, smollm, tmp_path, monkeypatch, faster):
    """A stored lookup route drifts (its stored acceptance is set out of reach) and re-tunes; its
    result (forced: plain) is timed against the stored lookup on the requests it tuned on, and
    replaces the best only when it was at least as fast (the timing of plain decoding is scaled
    100x either way, so the outcome does not hang on this machine's speeds); its history row is
    written either way."""
    import autotune.serving.adaptive.results as results
    from autotune.serving.adaptive.retune import Run, timed

    def scaled(decoder, prompts, eos, tokens):
        run = timed(decoder, prompts, eos, tokens)
        if decoder.drafter is not None:
            return run
        return Run(run.outputs, run.tokens, run.seconds / 100 if faster else run.seconds * 100)

    monkeypatch.setattr(results, "timed", scaled)
    monkeypatch.setattr(Retune, "outcome", lambda self: (PLAIN, 10.0, None, None))
    url = f"sqlite:///{tmp_path / 'store.db'}"
    key = strategy_key(smollm, None, "humaneval", "cpu")
    with open_storage(url) as storage:
        old = storage.record(key, LOOKUP, ResultMetrics.from_throughput(50.0, acceptance=0.99),
                             prompts=routing_texts("humaneval", 8, 0))
    settings = AdaptSettings(min_requests=2, retune_requests=1, slower_margin=0.99)
    storage, live = _serve(pool, url, route_distance=0.99, adaptive=settings)
    with live:
        client = live.client()
        for text in routing_texts("humaneval", 4, 20):
            chat(client, text, max_tokens=16)
        assert _health(live)["routes"]["humaneval"]["retunes"] == 1
        history = storage.history(key)
        assert len(history) == 2
        best = storage.best(key)
        assert (best.history_id, best.strategy) == ((history[1].id, PLAIN) if faster else (old, LOOKUP))
        if not faster:  # kept, and judged from now on against the acceptance it measured here (no loop)
            chat(client, routing_texts("humaneval", 1, 30)[0], max_tokens=16)
            route = _health(live)["routes"]["humaneval"]
            assert route["strategy"] == str(storage.best(key).id) and route["stored_acceptance"] < 0.9, route
    storage.close()


@pytest.mark.heavy  # a re-tune on live traffic into a new route
def test_a_new_route_never_overwrites_another_replicas(pool, smollm, tmp_path):
    """Another replica stored a route of the same name after this server last read the store:
    this server's new route takes the next free name."""
    url = f"sqlite:///{tmp_path / 'store.db'}"
    settings = AdaptSettings(new_route_requests=2, retune_requests=1)
    storage, live = _serve(pool, url, adaptive=settings)
    name = new_route_name(TRANSLATE[:2], [], readable=False)
    with live:
        theirs = storage.record(strategy_key(smollm, None, name, "cpu"), LOOKUP,
                                ResultMetrics.from_throughput(1e-3), prompts=["another replica's topic"])
        client = live.client()
        for text in TRANSLATE[:3]:
            chat(client, text, max_tokens=8)
        routes = _auto_routes(storage)
        assert set(routes) == {name, f"{name}-2"}
        assert (routes[name].history_id, routes[name].strategy) == (theirs, LOOKUP)
    storage.close()


# ---------------------------------------------------------------------- drift, like with like
def _sampled(live: LiveServer, text: str, seed: int) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 32,
            "temperature": 1.0, "seed": seed}
    r = httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["autotune"]


@pytest.mark.heavy  # 8 sampled requests of 32 tokens on a route watched for drift, after 4 greedy decodes to store it
def test_unchanged_traffic_at_temperature_1_triggers_no_retune(pool, smollm, tmp_path):
    """A lookup route stored with the acceptance it measured greedily on HumanEval gets the same
    kind of prompts sampled at temperature 1: its acceptance is lower, as sampling makes it, and
    that is not drift. Clients' plain overrides feed no route's plain speed."""
    url = f"sqlite:///{tmp_path / 'store.db'}"
    key = strategy_key(smollm, None, "humaneval", "cpu")
    dec = build_decoder(pool, smollm, LOOKUP)
    greedy = None
    for text in routing_texts("humaneval", 4, 0):
        ids = encode_prompt(Prompt(id="p", messages=(("user", text),)), smollm.tokenizer)
        stats = dec.generate(ids, GenerationConfig(max_new_tokens=32, eos_token_ids=eos_ids(smollm))).stats
        greedy = stats if greedy is None else greedy.merge(stats)
    with open_storage(url) as storage:
        storage.record(key, LOOKUP, ResultMetrics.from_throughput(greedy.tokens_per_s,
                                                                  acceptance=greedy.acceptance_rate),
                       prompts=routing_texts("humaneval", 8, 0))
    # speed is not what this test is about: only a route at a tenth of plain's speed falls back
    settings = AdaptSettings(min_requests=2, slower_margin=0.9)
    storage, live = _serve(pool, url, route_distance=0.99, adaptive=settings)
    with live:
        client = live.client()
        for i, text in enumerate(routing_texts("humaneval", 8, 20)):
            info = _sampled(live, text, seed=i)
            assert info["route"] == "humaneval" and info["state"] == "stored", info
        for text in POEMS:
            chat(client, text, strategy="plain", max_tokens=4)
        route = _health(live)["routes"]["humaneval"]
        assert route["retunes"] == 0 and route["requests"] == 8, route
        assert route["sampled_acceptance"] is not None and route["plain_tokens_per_s"] is None
    storage.close()


# ---------------------------------------------------------------------- explicit ids
@pytest.mark.heavy  # a concurrency test that waits out 8 s store lookups
def test_a_slow_explicit_id_lookup_holds_up_no_other_request(pool, smollm, tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'store.db'}"
    storage, live = _serve(pool, url)
    row = storage.record(strategy_key(smollm, None, "t", "cpu"), LOOKUP, ResultMetrics.from_throughput(10.0))
    best_id = next(b.id for b in storage.list_best() if b.history_id == row)
    real_get = storage.get

    def slow_get(best_id):
        time.sleep(8)
        return real_get(best_id)

    monkeypatch.setattr(storage, "get", slow_get)
    with live:
        client = live.client()
        chat(client, "hi", max_tokens=2)  # warm
        with cf.ThreadPoolExecutor(12) as ex:
            slow = [ex.submit(chat, client, "hi", str(best_id), max_tokens=2) for _ in range(8)]
            time.sleep(0.5)  # the lookups are under way
            t0 = time.monotonic()
            quick = [ex.submit(chat, client, text, max_tokens=2) for text in POEMS]
            for f in quick:
                f.result()
            took = time.monotonic() - t0
            assert all(f.result()[2]["strategy"] == str(best_id) for f in slow)
        assert took < 6, took  # before: 8 lookups filled the tokenising threads for 8 s or more
    storage.close()
