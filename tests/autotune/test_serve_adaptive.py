"""Adaptive serving with real SmolLM2 on loopback (slow tier): drift on a stored route is
detected, decoding falls back to plain, the route re-tunes on live traffic and the result is
stored as an update of its entry with history; unknown traffic becomes a new route that later
requests use; greedy responses equal plain decoding throughout.

The drift rule itself (``judge``) and the naming of new routes are tested without models below.
"""
from __future__ import annotations

import httpx
import pytest

from autotune.errors import SettingError
from autotune.serving.adaptive.adaptive import PendingClusters, RouteHealth, judge, new_route_name, unique_name
from autotune.serving.adaptive.settings import AdaptSettings
from autotune.serving.server import ServeConfig, build_server
from autotune.store.records import ResultMetrics
from autotune.store.resolve import strategy_key
from autotune.store.storage import open_storage
from runtime.decoding import GenerationConfig
from runtime.pipeline import build_decoder, eos_ids
from runtime.stats import DecodeStats
from search_spaces import uniform_skip_plan
from search_spaces.strategy import PLAIN, Strategy
from studies import Prompt, encode_prompt
from tests.helpers import MODEL, TRANSLATE, LiveServer, chat, routing_texts, settled

LOOKUP = Strategy(drafter="prompt-lookup", draft_length=6)
# a second kind of unknown traffic, far from both code and the translations
RECIPES = [f"Suggest an easy dinner recipe with {s}, and list the steps in order." for s in (
    "chickpeas, spinach and garlic", "salmon, lemon and dill", "mushrooms, rice and thyme",
    "lentils, carrots and cumin", "tofu, ginger and broccoli", "potatoes, leeks and cream",
    "eggs, peppers and onions", "pasta, tomatoes and basil",
)]


# ---------------------------------------------------------------------------------- the rule
def stats(drafted: int, accepted: int, tokens: int, decode_s: float) -> DecodeStats:
    s = DecodeStats(new_tokens=tokens + 1, drafted=drafted, accepted=accepted, wall_s=decode_s + 0.1, prefill_s=0.1)
    s.draft_rounds = max(drafted // 4, 1) if drafted else 0
    return s


def test_judge_waits_then_flags_acceptance_drift_and_slowness():
    s = AdaptSettings(min_requests=2, acceptance_drop=0.25, slower_margin=0.05, ewma=0.5, acceptance_floor_drop=0.1)
    h = RouteHealth("humaneval", LOOKUP, "1", stored_acceptance=0.8)
    h.observe(stats(40, 12, 30, 2.0), s.ewma)  # acceptance 0.3, 15 tok/s
    assert judge(h, plain_tps=10.0, settings=s) is None  # one request says nothing yet
    h.observe(stats(40, 12, 30, 2.0), s.ewma)
    assert "acceptance 0.30 < 0.60" in judge(h, 10.0, s)
    # a relative drop of a small acceptance is noise: it must also fall by the floor (0.1)
    low = RouteHealth("mt", LOOKUP, "4", stored_acceptance=0.08)
    for _ in range(2):
        low.observe(stats(40, 0, 30, 2.0), s.ewma)
    assert judge(low, 10.0, s) is None
    slow = RouteHealth("gsm8k", LOOKUP, "2", stored_acceptance=0.3)
    for _ in range(2):
        slow.observe(stats(40, 12, 30, 4.0), s.ewma)  # 7.5 tok/s
    assert judge(slow, 10.0, s).startswith("slower than plain")
    assert judge(slow, 7.6, s) is None  # within the margin of plain: neither slow nor drifted
    # a plain route has nothing to drift: it re-checks speculation after recheck_plain_requests
    s = AdaptSettings(min_requests=2, acceptance_drop=0.25, ewma=0.5, recheck_plain_requests=9)
    assert judge(RouteHealth("mt", PLAIN, "plain", None, requests=8), 10.0, s) is None
    assert judge(RouteHealth("mt", PLAIN, "plain", None, requests=9), 10.0, s).startswith("plain for 9 requests")
    # a row stored without acceptance takes its first figure
    fresh = RouteHealth("x", LOOKUP, "3", stored_acceptance=None)
    for _ in range(2):
        fresh.observe(stats(40, 30, 30, 1.0), s.ewma)
    assert judge(fresh, 10.0, s) is None and fresh.stored_acceptance == pytest.approx(0.75)


def test_new_route_names_come_from_the_pending_texts():
    known = ["def add(a, b):\n    return a + b", "Write a function that sorts a list."]
    name = new_route_name(TRANSLATE[:5], known)
    assert name.startswith("auto:") and "french" in name.split(":")[1].split("-")
    assert new_route_name(["1 2 3", "4 5"], known) == "auto:general"


def test_pending_unknown_traffic_clusters_by_topic():
    pending = PendingClusters(threshold=0.65, max_clusters=2, max_texts=4)
    ids = []
    for translate, recipe in zip(TRANSLATE[:5], RECIPES[:5]):
        for text in (translate, recipe):
            cid = pending.assign(text)
            pending.add(cid, text)
            ids.append(cid)
    assert ids[0::2] == [ids[0]] * 5 and ids[1::2] == [ids[1]] * 5 and ids[0] != ids[1]
    assert pending.sizes() == {ids[0]: 4, ids[1]: 4}  # at most max_texts each, the newest kept
    assert pending.texts(ids[0]) == TRANSLATE[1:5]
    # a third topic opens a third cluster, which drops the one that grew least recently
    code = "Implement a binary search tree with insert and delete in Rust."
    third = pending.assign(code)
    assert third not in ids
    pending.add(third, code)
    assert set(pending.sizes()) == {ids[1], third}
    pending.drop(third)
    assert pending.assign(code) not in (third, *ids)  # ids are never reused


def test_new_route_names_never_overwrite_a_route():
    assert unique_name("auto:french-translate", set()) == "auto:french-translate"
    taken = {"auto:french-translate", "auto:french-translate-2"}
    assert unique_name("auto:french-translate", taken) == "auto:french-translate-3"


@pytest.mark.parametrize("field,value", [("min_requests", 0), ("acceptance_drop", 0.0), ("retune_share", 1.5),
                                          ("ewma", True), ("new_route_requests", 2.5),
                                          ("new_route_requests", 65), ("recheck_plain_requests", 0)])
def test_settings_are_validated(field, value):
    with pytest.raises(SettingError, match=field):
        AdaptSettings(**{field: value})


# ---------------------------------------------------------------------------------- live
def plain_ids(pool, smollm, text: str, max_tokens: int) -> list[int]:
    ids = encode_prompt(Prompt(id="p", messages=(("user", text),)), smollm.tokenizer)
    cfg = GenerationConfig(max_new_tokens=max_tokens, eos_token_ids=eos_ids(smollm))
    return build_decoder(pool, smollm, PLAIN).generate(ids, cfg).tokens


def measured_acceptance(pool, smollm, texts: list[str], max_tokens: int) -> tuple[float, float]:
    """LOOKUP's acceptance and tokens/s on ``texts``: what a study would have stored."""
    dec = build_decoder(pool, smollm, LOOKUP)
    total = DecodeStats()
    for text in texts:
        ids = encode_prompt(Prompt(id="p", messages=(("user", text),)), smollm.tokenizer)
        total = total.merge(dec.generate(ids, GenerationConfig(max_new_tokens=max_tokens,
                                                               eos_token_ids=eos_ids(smollm))).stats)
    return total.acceptance_rate, total.tokens_per_s


def store_humaneval_lookup(storage, pool, smollm, task: str, prompts: list[str], tokens: int) -> tuple[object, int]:
    """Store LOOKUP under ``task`` with the acceptance and speed it measured on HumanEval (what a
    study would have stored): -> (its key, its history row)."""
    acceptance, tps = measured_acceptance(pool, smollm, routing_texts("humaneval", 4, 0), tokens)
    key = strategy_key(smollm, None, task, "cpu")
    return key, storage.record(key, LOOKUP, ResultMetrics.from_throughput(tps, acceptance=acceptance), prompts=prompts)


@pytest.mark.slow
@pytest.mark.heavy  # a re-tune on live traffic: up to 14 requests of 32 tokens, each checked against plain decoding
def test_drift_falls_back_retunes_and_stores_with_history(pool, smollm, tmp_path):
    """A route stored from HumanEval (prompt lookup, with the acceptance it measured there)
    receives GSM8K traffic: within a bounded number of requests the drift is detected, the route
    decodes plainly while it re-tunes, and the re-tuned result replaces the entry (history kept)."""
    url = f"sqlite:///{tmp_path / 'store.db'}"
    tokens = 32
    with open_storage(url) as storage:
        key, old = store_humaneval_lookup(storage, pool, smollm, "humaneval", routing_texts("humaneval", 8, 0), tokens)
        settings = AdaptSettings(min_requests=2, retune_requests=3, store_prompts=True)
        # every request routes to the one stored task (the GSM8K traffic lands on HumanEval's route)
        server = build_server(ServeConfig(model=MODEL, storage=url, route_distance=0.99, adaptive=settings),
                              storage, pool=pool)
        with LiveServer(server) as live:
            client = live.client()
            infos = []
            sent = routing_texts("humaneval", 2, 20) + routing_texts("gsm8k", 12, 0)
            for i, text in enumerate(sent):
                got, ids, info = chat(client, text, max_tokens=tokens)
                assert ids == plain_ids(pool, smollm, text, tokens), i  # lossless in every state
                assert info["route"] == "humaneval"
                infos.append(info)
                if len([x for x in infos if x["state"] == "tuning"]) == settings.retune_requests:
                    break
            states = [x["state"] for x in infos]
            assert states[:2] == ["stored", "stored"] and all(x["drafted"] > 0 for x in infos[:2])  # no false alarm
            first = states.index("tuning")
            # caught within 8 requests of the shift (SmolLM2's lookup acceptance: ~0.3 on these
            # HumanEval prompts, ~0.15 on GSM8K's, noisy per 32-token request; the EWMA needs a few)
            assert first <= 2 + 8
            assert infos[first]["strategy"] == "tuning" and infos[first]["drafted"] == 0  # plain at once
            settled(server)
            events = server.worker.adapter.events
            # the result replaces the entry ("stored") when it decoded the re-tune's requests at least
            # as fast as the stored lookup, else the entry stays ("kept"; the rule is tested apart,
            # with controlled timings, in test_serve_bounds); either way with history
            assert [e["event"] for e in events] in (["retune", "stored"], ["retune", "kept"])
            assert events[0]["route"] == "humaneval"
            health = httpx.get(f"{live.url}/health").json()["routes"]
            assert health["humaneval"]["retunes"] == 1
            history = storage.history(key)
            best = storage.best(key)
            assert [h.id for h in history][0] == old and len(history) == 2
            assert history[1].id == events[1]["history_id"] and history[1].study_name == "serve:humaneval"
            assert best.history_id == (history[1].id if events[1]["event"] == "stored" else old)
            # the route's prompts, then the texts of the requests it re-tuned on
            tuned_on = sent[first:first + settings.retune_requests]
            assert storage.prompts(history[1].id) == routing_texts("humaneval", 8, 0) + tuned_on
            # later requests decode with the re-tuned entry (stored state again)
            text = routing_texts("gsm8k", 1, 30)[0]
            _, ids, info = chat(client, text, max_tokens=tokens)
            assert info["state"] == "stored" and ids == plain_ids(pool, smollm, text, tokens)
            assert server.book.entries[0].strategy == best.strategy


@pytest.mark.slow
@pytest.mark.heavy  # two clusters of unknown traffic re-tune into new routes on live traffic (14 requests, each checked)
def test_unknown_traffic_becomes_new_routes_by_topic(pool, smollm, tmp_path):
    url = f"sqlite:///{tmp_path / 'store.db'}"
    key = strategy_key(smollm, None, "humaneval", "cpu")
    with open_storage(url) as storage:
        storage.record(key, LOOKUP, ResultMetrics.from_throughput(20.0, acceptance=0.5),
                       prompts=routing_texts("humaneval", 8, 0))
        settings = AdaptSettings(new_route_requests=3, retune_requests=2, store_prompts=True)
        server = build_server(ServeConfig(model=MODEL, storage=url, adaptive=settings), storage, pool=pool)
        with LiveServer(server) as live:
            client = live.client()
            routes, clusters = [], {"translate": set(), "recipe": set()}
            for translate, recipe in zip(TRANSLATE[:5], RECIPES[:5]):  # two kinds of unknown traffic, interleaved
                for kind, text in (("translate", translate), ("recipe", recipe)):
                    _, ids, info = chat(client, text, max_tokens=16)
                    assert ids == plain_ids(pool, smollm, text, 16)
                    routes.append((info["route"], info["state"]))
                    clusters[kind].add(info["cluster"])  # the pending cluster it joined, in the response
            assert routes[:6] == [("unknown", "stored")] * 6
            assert all(len(ids) == 1 for ids in clusters.values()) and clusters["translate"] != clusters["recipe"]
            assert routes[6:] == [("unknown", "tuning")] * 4  # each kind re-tunes as its own cluster
            created = {e["task"]: e for e in server.worker.adapter.events if e["event"] == "stored"}
            assert len(created) == 2 and all(task.startswith("auto:") for task in created)
            stored = {b.key.task: set(storage.prompts(b.history_id)) for b in storage.list_best()}
            by_kind = {}
            for kind, sample in (("translate", TRANSLATE), ("recipe", RECIPES)):
                [task] = [t for t in created if stored[t] == set(sample[:5])]
                by_kind[kind] = task
            for kind, text in (("translate", TRANSLATE[5]), ("recipe", RECIPES[5]),
                               ("translate", TRANSLATE[6]), ("recipe", RECIPES[6])):  # routed to the new entries
                _, ids, info = chat(client, text, max_tokens=16)
                assert info["route"] == by_kind[kind] and ids == plain_ids(pool, smollm, text, 16)


@pytest.mark.slow
@pytest.mark.parametrize("adaptive", [
    pytest.param(True, id="adaptive"),
    # the same start on a second server that is not adaptive: a second start-up (draft costs measured again)
    pytest.param(False, id="not-adaptive", marks=pytest.mark.heavy),
])
def test_unknown_traffic_starts_on_what_the_server_measured(pool, smollm, tmp_path, adaptive):
    """With nothing stored for unknown traffic, a server decodes it with the start it measured
    (``DecodeWorker.unknown_start``: its default draft chain where that pays, else plainly; SmolLM2
    drafting for itself is near the line, so either may be measured here), adaptive or not, and
    the answer is plain decoding's; an adaptive one watches it like a route."""
    url = f"sqlite:///{tmp_path / 'store.db'}"
    with open_storage(url) as storage:
        settings = AdaptSettings() if adaptive else None
        server = build_server(ServeConfig(model=MODEL, draft=MODEL, storage=url, adaptive=settings),
                              storage, pool=pool)
        assert server.book.default.speculates  # what it used to start on
        with LiveServer(server) as live:
            got, ids, info = chat(live.client(), TRANSLATE[0], max_tokens=16)
            start = "default" if server.book.fallback.speculates else "plain"
            assert server.book.fallback in (PLAIN, server.book.default)
            assert (info["route"], info["strategy"]) == ("unknown", start)
            assert start == "default" or info["drafted"] == 0
            assert ids == plain_ids(pool, smollm, TRANSLATE[0], 16)
            if settings is not None:
                settled(server)
                assert server.worker.adapter.describe()["unknown"]["requests"] == 1


# a layer plan that skips most of SmolLM2's layers: its drafts are mostly rejected
POOR = Strategy(drafter="layer-skip", draft_length=4, layer_plan=uniform_skip_plan(30, 0.7))


def starts_plainly(info: dict) -> bool:
    """Whether a response's request started plainly and drafted nothing (the live start)."""
    return info["control"]["start"] == "plain" and info["drafted"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("rule", [
    pytest.param("live", id="live-start"),
    # power check: the assumed figure's rule (every unknown request starts on its stored strategy)
    pytest.param("assumed", id="power-check", marks=pytest.mark.heavy),
])
def test_a_cluster_that_drafted_at_a_loss_starts_its_next_request_plainly(pool, smollm, tmp_path, rule):
    """Unknown requests of one kind whose drafts were mostly rejected - each shorter than the
    controller's first window, so nothing inside them could change course - make the next request
    of their pending cluster start plainly (``Control.live_start``), with plain decoding's output.
    The power check starts every request from the assumed figure, as before, and the next request
    drafts at a loss again: the check above would catch it."""
    url = f"sqlite:///{tmp_path / 'store.db'}"
    with open_storage(url) as storage:  # the general entry: what unknown requests decode with
        storage.record(strategy_key(smollm, None, "prompts", "cpu"), POOR, ResultMetrics.from_throughput(20.0))
        settings = AdaptSettings(min_requests=50, new_route_requests=50)  # no judgement, no new route here
        server = build_server(ServeConfig(model=MODEL, storage=url, adaptive=settings), storage, pool=pool)
        control = server.worker.control
        if rule == "assumed":
            control.live_start = lambda job, strategy, dec: None
        with LiveServer(server) as live:
            client = live.client()
            _, _, first = chat(client, TRANSLATE[0], max_tokens=24)  # nothing measured yet: the stored strategy
            assert first["route"] == "unknown" and not starts_plainly(first)
            assert first["drafted"] >= server.worker.figures.acceptance.min_drafts
            live_acceptance = server.worker.figures.acceptance.get(f"unknown#{first['cluster']}", POOR)
            assert live_acceptance is not None and live_acceptance < 0.5
            cost = control.cost(server.worker.decoders.decoder(POOR))
            assert not control._pays(cost, POOR, live_acceptance)  # drafting at this acceptance is a loss
            for text in TRANSLATE[1:3]:
                _, ids, info = chat(client, text, max_tokens=24)
                assert info["cluster"] == first["cluster"] and ids == plain_ids(pool, smollm, text, 24)
                assert starts_plainly(info) == (rule == "live")


@pytest.mark.slow
@pytest.mark.heavy  # a re-tune on live traffic: up to 12 GSM8K requests of 32 tokens, each checked against plain decoding
def test_unknown_traffic_drift_retunes_the_general_entry(pool, smollm, tmp_path):
    """The general entry (task ``prompts``: what unknown traffic decodes with) is judged like a
    route: stored from HumanEval with the acceptance lookup measured there, it receives GSM8K
    traffic far from its prompts, drifts, re-tunes on that traffic and is replaced with history."""
    url = f"sqlite:///{tmp_path / 'store.db'}"
    tokens = 32
    with open_storage(url) as storage:
        key, old = store_humaneval_lookup(storage, pool, smollm, "prompts", TRANSLATE, tokens)
        settings = AdaptSettings(min_requests=2, retune_requests=2, new_route_requests=60)
        # a tight route distance: every GSM8K request is "unknown" and decodes with the general entry
        server = build_server(ServeConfig(model=MODEL, storage=url, route_distance=0.01, adaptive=settings),
                              storage, pool=pool)
        with LiveServer(server) as live:
            client = live.client()
            states = []
            for text in routing_texts("gsm8k", 12, 0):
                _, ids, info = chat(client, text, max_tokens=tokens)
                assert ids == plain_ids(pool, smollm, text, tokens)
                assert info["route"] == "unknown"
                states.append(info["state"])
                # a re-tune's request reports the tuning it carried; a stored one none
                assert ("tuning" in info) == (info["state"] == "tuning")
                if info["state"] == "tuning":
                    assert info["tuning"]["tuning_s"] >= 0 and info["tuning"]["request"] >= 1
                if server.worker.adapter.events and server.worker.adapter.events[-1]["event"] in ("stored", "kept"):
                    break
            assert "tuning" in states, states
            # replaced, or kept when the stored lookup decoded the re-tune's requests faster (see above)
            [result] = [e for e in server.worker.adapter.events if e["event"] in ("stored", "kept")]
            assert result["route"] == "unknown" and result["task"] == "prompts"
            best = next(b for b in storage.list_best() if b.key.task == "prompts")
            assert len(storage.history(key)) == 2
            assert (best.history_id == old) == (result["event"] == "kept")


def _pg_database(base: str, name: str) -> str:
    import psycopg

    with psycopg.connect(base.replace("postgresql+psycopg", "postgresql") + "/postgres", autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return f"{base}/{name}"


@pytest.mark.slow
@pytest.mark.heavy  # two servers and a re-tune on live traffic (runs where the PostgreSQL tests run)
def test_replicas_on_one_postgresql_store_share_a_retune(pool, smollm, request, monkeypatch):
    """Two servers on one PostgreSQL store: a route re-tuned on one is routed to by the other
    within its poll interval (no coordinator: the store is the shared state). Runs where the
    PostgreSQL tests run (AUTOTUNE_TEST_POSTGRES=1, as CI sets when it has the server). The
    re-tune's result is plain decoding, timed 100x faster in its check, so it replaces the stored
    lookup whatever this machine measures (the rule itself is tested in test_serve_bounds)."""
    import os
    import time

    import autotune.serving.adaptive.results as results
    from autotune.serving.adaptive.retune import Retune, Run, timed

    def plain_wins(decoder, prompts, eos, tokens):
        run = timed(decoder, prompts, eos, tokens)
        return run if decoder.drafter is not None else Run(run.outputs, run.tokens, run.seconds / 100)

    monkeypatch.setattr(results, "timed", plain_wins)
    monkeypatch.setattr(Retune, "outcome", lambda self: (PLAIN, self.plain_tps() or 1.0, None, None))

    url = _pg_database(request.getfixturevalue("postgres_server"), f"autotune_replicas_{os.getpid()}")
    tokens = 32
    acceptance, tps = measured_acceptance(pool, smollm, routing_texts("humaneval", 4, 0), tokens)
    key = strategy_key(smollm, None, "humaneval", "cpu")
    with open_storage(url) as store_a, open_storage(url) as store_b:
        store_a.record(key, LOOKUP, ResultMetrics.from_throughput(tps, acceptance=acceptance),
                       prompts=routing_texts("humaneval", 8, 0))
        settings = AdaptSettings(min_requests=2, retune_requests=2)
        config = ServeConfig(model=MODEL, storage=url, route_distance=0.99, adaptive=settings, refresh_s=0.5)
        a = build_server(config, store_a, pool=pool)
        b = build_server(config, store_b, pool=pool)
        with LiveServer(a, refresh_s=0.5) as live_a, LiveServer(b, refresh_s=0.5) as live_b:
            assert b.book.entries[0].strategy == LOOKUP
            client = live_a.client()
            for text in routing_texts("gsm8k", 10, 0):  # drift on replica A until it stored its re-tune
                chat(client, text, max_tokens=tokens)
                if any(e["event"] == "stored" for e in a.worker.adapter.events):
                    break
            stored = store_a.best(key)
            assert stored.study_name == "serve:humaneval" and len(store_a.history(key)) == 2
            deadline = time.time() + 10
            while b.book.entries[0].strategy != stored.strategy or b.book.entries[0].history_id != stored.history_id:
                assert time.time() < deadline, "replica B did not pick up A's re-tune"
                time.sleep(0.1)
            text = routing_texts("gsm8k", 1, 40)[0]
            _, ids, info = chat(live_b.client(), text, max_tokens=tokens)
            assert info["route"] == "humaneval" and ids == plain_ids(pool, smollm, text, tokens)
            assert (info["drafted"] > 0) == stored.strategy.speculates  # B decodes with A's result


def test_instruction_is_the_template_part_or_the_first_sentence():
    from autotune.serving.adaptive.clusters import instruction

    assert instruction("Summarise the following article in one sentence.\n\nArticle:\nThe trailer...") == \
        "Summarise the following article in one sentence."
    assert instruction(TRANSLATE[0]) == "Translate this sentence into French, keeping its tone:"
    assert instruction("Where is the White House? It is not red.") == "Where is the White House?"
    assert instruction("no end at all") == "no end at all"


def test_pending_clusters_group_unknown_categories_by_task_form():
    """The mixed stream's XSum, NQ-open and ASDiv requests (prompts 20-31, stream order): one
    cluster per category (adjusted Rand index >= 0.8). Content words alone do not get there:
    article summaries share their instruction, not their words."""
    from autotune.serving.adaptive.cluster_eval import UNKNOWN_TASKS, content_only, score

    ari, n_clusters, _ = score(UNKNOWN_TASKS)
    assert ari >= 0.8 and n_clusters == 3
    words_ari, words_clusters, _ = score(UNKNOWN_TASKS, vectors=content_only)
    assert words_ari < 0.8 and words_clusters > 3

