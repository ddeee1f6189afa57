"""`autotune replay`: the schedule, the report's arithmetic, the plot and the command's errors (no
model: a fake server answers through an httpx mock transport), and one slow run against a real
`autotune serve` on loopback."""
from __future__ import annotations

import json
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

import autotune.cli.main
import autotune.cli.replay
from autotune.errors import MethodError, SettingError
from autotune.measure.replay import CHOSEN, ReplayClient, ReplayRecord, ReplaySettings, base_url, forced_mode, \
    parse_modes, replay, send_order
from autotune.reports.replay_report import aggregate, bands, category_bands, clustering, combined, forced, format_table, \
    identical, repeat_spread, replay_plot, row, switches
from studies import Prompt, StreamRequest, write_stream
from tests.helpers import LiveServer, assert_one_line_error, run


def _request(index: int, category: str, text: str = "") -> StreamRequest:
    body = text or f"{category} question {index}"
    return StreamRequest(index, category, Prompt(id=f"{category}/{index}", messages=(("user", body),)))


def _record(index: int, category: str, mode: str, **kw: Any) -> ReplayRecord:
    fields = dict(index=index, category=category, mode=mode, prompt_id=f"{category}/{index}", completion_tokens=10,
                  route=category, distance=0.1, strategy="plain" if mode == "plain" else "3", state="stored",
                  drafted=0, accepted=0, draft_rounds=0, tokens_per_s=10.0, ttft_s=0.05, latency_s=1.0,
                  token_ids=(1, 2, 3))
    return ReplayRecord(**{**fields, **kw})


# ---------------------------------------------------------------------- pure parts
def test_a_load_point_takes_the_stream_one_category_at_a_time() -> None:
    """The ``mixed`` stream comes in blocks of one category: a load point's first requests take
    each category in turn, so that a point of few requests is not one task's."""
    from autotune.measure.loadtest import interleaved

    blocks = [_request(i, c) for i, c in enumerate("aaabbbcc")] + [_request(8, "a")]
    got = interleaved(blocks)
    assert [(r.category, r.index) for r in got] == [("a", 0), ("b", 3), ("c", 6), ("a", 1), ("b", 4), ("c", 7),
                                                     ("a", 2), ("b", 5), ("a", 8)]
    assert sorted(r.index for r in got) == list(range(9)) and interleaved([]) == []


def _turns(conversation: str, category: str, start: int) -> list[StreamRequest]:
    return [StreamRequest(start + t, category, Prompt(id=f"{conversation}/turn-{t + 1}", messages=(("user", "q"),)),
                          conversation) for t in range(2)]


def test_a_conversation_stays_together_and_goes_to_one_client_in_order() -> None:
    """Multi-turn traffic: a conversation's turns are one unit wherever the load test slices or
    interleaves the stream, and one client sends them in order (its second turn after its first's
    answer), so the second turn can find the first one's rows cached."""
    from autotune.measure.loadtest import conversations, first_requests, interleaved

    stream = _turns("x", "a", 0) + [_request(2, "a")] + _turns("y", "b", 3) + _turns("z", "a", 5)
    assert [[r.index for r in u] for u in conversations(stream)] == [[0, 1], [2], [3, 4], [5, 6]]
    got = interleaved(stream)
    assert [r.index for r in got] == [0, 1, 3, 4, 2, 5, 6]
    assert [r.index for r in first_requests(got, 1)] == [0, 1]  # the rest of the conversation comes along
    assert [r.index for r in first_requests(got, 3)] == [0, 1, 3, 4]
    assert [r.index for r in first_requests(got, 5)] == [0, 1, 3, 4, 2]
    assert first_requests([], 3) == []


class _PassClient:
    """A server for ``load_test``'s passes: records each chat as (pass, request index, thread) and
    whether a cache reset came before each pass."""

    def __init__(self, settings: ReplaySettings, transport: Any = None) -> None:
        self.passes = 0
        self.sent: list[tuple[int, int, int]] = []
        self.http = self
        _PassClient.last = self

    def __enter__(self) -> "_PassClient":
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def get(self, path: str) -> Any:  # /metrics: a server without batching counters
        return type("R", (), {"status_code": 404})()

    def model_name(self) -> str:
        return "m"

    def reset_cache(self) -> bool:
        self.passes += 1
        return True

    def chat(self, model: str, request: StreamRequest, mode: str) -> Any:
        self.sent.append((self.passes, request.index, threading.get_ident()))
        return type("Rec", (), {"ttft_s": 0.01, "completion_tokens": 3})()


def test_each_load_pass_starts_on_a_reset_cache_and_sends_conversations_whole(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Levels, rounds and modes repeat the same requests: each pass starts after a cache reset
    (no pass finds what an earlier one left), and a conversation's turns go in order from one client."""
    import autotune.measure.loadtest as lt

    monkeypatch.setattr(lt, "ReplayClient", _PassClient)
    stream = _turns("x", "a", 0) + _turns("y", "b", 2) + [_request(4, "c"), _request(5, "c")]
    points = lt.load_test([("s", "http://x")], stream, ["plain", "auto"], [1, 2], max_tokens=3, timeout_s=5,
                          per_client=1, min_requests=3, rounds=2, warmup=1)
    client = _PassClient.last
    assert client.passes == 2 * 2 * 2  # levels x rounds x modes
    warm = [s for s in client.sent if s[0] == 0]
    assert [i for _, i, _ in warm] == [4, 4]  # a warm-up request per mode, before any pass, past every point's
    for n in range(1, client.passes + 1):
        sent = [(i, t) for k, i, t in client.sent if k == n]
        assert sorted(i for i, _ in sent) == [0, 1, 2, 3]  # two conversations whole (a point of 3 requests)
        by_index = dict(sent)
        assert by_index[0] == by_index[1] and by_index[2] == by_index[3]  # one client per conversation
        order = [i for i, _ in sent]
        assert order.index(0) < order.index(1) and order.index(2) < order.index(3)
    assert [(p.mode, p.concurrency, p.requests, p.rounds) for p in points] == [
        ("plain", 1, 8, 2), ("auto", 1, 8, 2), ("plain", 2, 8, 2), ("auto", 2, 8, 2)]  # 4 requests a pass


def test_the_warm_up_shares_the_least_prompt_with_the_measured_requests() -> None:
    """A server keeps a warm-up's prompt (llama-server in a slot, for the whole pass): a warm-up
    opening like a measured request (GSM8K's few-shot prefix) would skip that request's prefill
    there. Power: the first spare request, the old choice, is the one that shares the prefix."""
    from autotune.measure.loadtest import warm_requests

    shots = "Question: 2 + 2? Answer: 4. " * 20
    stream = [_request(0, "gsm8k", shots + "Question: 3 + 4?"), _request(1, "chat", "hello"),
              _request(2, "gsm8k", shots + "Question: 5 + 6?"), _request(3, "chat", "Tell me a story"),
              _request(4, "translation", "Translate: good morning")]
    assert [r.index for r in warm_requests(stream, 2, 1)] == [3]  # not 2, which opens like request 0
    assert [r.index for r in warm_requests(stream, 2, 2)] == [3, 4]  # equals in stream order
    assert [r.index for r in warm_requests(stream, 2, 3)] == [3, 4, 2]
    assert [r.index for r in warm_requests(stream, 5, 1)] == [1]  # no spare: the whole stream's least shared
    assert warm_requests(stream, 2, 0) == []


def test_a_load_point_sends_at_least_its_minimum() -> None:
    from autotune.measure.loadtest import point_size

    assert [point_size(c, 2, 8) for c in (1, 4, 16)] == [8, 8, 32]
    assert [point_size(c, 1, 1) for c in (1, 4)] == [1, 4]


@pytest.mark.parametrize("flag", ["--min-requests", "--requests-per-client", "--rounds"])
def test_loadtest_counts_below_one_are_one_line_errors(flag: str, capsys: pytest.CaptureFixture[str],
                                                       quiet_cli: None) -> None:
    _one_line_error(capsys, ["loadtest", "--url", "http://127.0.0.1:9", "--stream", "mixed", flag, "0"],
                    f"{flag} must be at least 1")


def test_a_negative_loadtest_warmup_is_a_one_line_error(capsys: pytest.CaptureFixture[str], quiet_cli: None) -> None:
    _one_line_error(capsys, ["loadtest", "--url", "http://127.0.0.1:9", "--stream", "mixed", "--warmup", "-1"],
                    "--warmup must be 0 or more")


def test_load_rounds_rotate_the_modes_so_none_always_runs_first() -> None:
    from autotune.measure.replay import rotated

    modes = ("plain", "default", "auto")
    orders = [rotated(modes, r) for r in range(4)]
    assert orders == [["plain", "default", "auto"], ["default", "auto", "plain"], ["auto", "plain", "default"],
                      ["plain", "default", "auto"]]
    assert {o[0] for o in orders[:3]} == set(modes) and rotated((), 2) == []


def test_a_load_point_pools_its_rounds() -> None:
    """Tokens and wall time are summed (not per-round rates averaged), latencies pooled, the step
    counters summed; each round's own rate is kept."""
    from autotune.measure.loadtest import _point, _Sample

    first = _Sample(((1.0, 0.1, 10), (3.0, 0.3, 30)), 4.0, {"autotune:batch_size_sum": 4.0,
                                                          "autotune:batch_size_count": 4.0,
                                                          "autotune:batch_rows_sum": 8.0})
    second = _Sample(((2.0, 0.2, 20),), 1.0, {"autotune:batch_size_sum": 2.0, "autotune:batch_size_count": 1.0,
                                              "autotune:batch_rows_sum": 2.0, "autotune:step_draft_tokens_sum": 3.0,
                                              "autotune:step_draft_tokens_count": 6.0})
    point = _point([first, second], "new", "auto", 2)
    assert (point.requests, point.tokens, point.wall_s, point.rounds) == (3, 60, 5.0, 2)
    assert point.tokens_per_s == 12.0 and point.round_tokens_per_s == (10.0, 20.0)
    assert point.latency_p50_s == 2.0 and point.ttft_p50_s == 0.2
    assert point.mean_batch == 6.0 / 5.0 and point.rows_per_step == 10.0 / 5.0 and point.draft_per_request == 0.5
    assert _point([first, _Sample(second.done, 1.0, None)], "new", "auto", 2).mean_batch is None  # one round unknown


def _load_point(mode: str, concurrency: int, rounds: tuple[float, ...], server: str = "new") -> Any:
    from autotune.measure.loadtest import LoadPoint

    tokens = 100 * len(rounds)
    wall = sum(100 / r for r in rounds)
    return LoadPoint(server=server, mode=mode, concurrency=concurrency, requests=len(rounds), tokens=tokens,
                     wall_s=wall, tokens_per_s=tokens / wall, requests_per_s=len(rounds) / wall, latency_p50_s=1.0,
                     latency_p95_s=1.0, ttft_p50_s=0.1, mean_batch=None, rows_per_step=None, rounds=len(rounds),
                     round_tokens_per_s=rounds)


def test_a_mode_is_compared_with_the_best_other_round_by_round() -> None:
    """``auto`` against the best other mode by pooled tok/s (not the best of each round), each round's
    ratio paired with the same round of that mode, and a t interval on the rounds' geometric mean."""
    import math

    from autotune.measure.loadtest import compare, format_comparisons

    e = math.exp(0.1)
    points = [_load_point("plain", 4, (9.0, 11.0)), _load_point("default", 4, (10.0, 10.0)),
              _load_point("auto", 4, (10.0 * e, 10.0 / e)),
              _load_point("plain", 1, (5.0,)), _load_point("auto", 1, (6.0,)),
              _load_point("auto", 16, (3.0, 3.0))]  # no other mode at 16 clients: nothing to compare
    first, second = compare(points)
    assert (first.concurrency, first.against, second.concurrency, second.against) == (4, "default", 1, "plain")
    assert first.round_ratios == pytest.approx((e, 1 / e))
    assert first.ratio == pytest.approx(points[2].tokens_per_s / 10.0)
    half = 12.706 * math.sqrt(0.02) / math.sqrt(2)  # t(0.975, 1 df) x stdev of the logs (+-0.1) / sqrt(2)
    assert (first.low, first.high) == (pytest.approx(math.exp(-half), rel=1e-3), pytest.approx(math.exp(half), rel=1e-3))
    assert (second.ratio, second.round_ratios, second.low, second.high) == (pytest.approx(1.2), (1.2,), None, None)
    assert compare(points, "default")[0].against == "auto" and compare(points, "tuned") == []
    table = format_comparisons([first, second])
    assert "| new | 4 | auto | default | " in table and "| new | 1 | auto | plain | 1.200 | 1.200 | - |" in table


def test_loadtest_compare_names_a_measured_mode(capsys: pytest.CaptureFixture[str], quiet_cli: None) -> None:
    _one_line_error(capsys, ["loadtest", "--url", "http://127.0.0.1:9", "--stream", "mixed", "--mode", "plain,default",
                             "--compare", "auto"], "--compare 'auto' is not among --mode plain,default")


def test_replay_sends_each_requests_modes_in_a_row() -> None:
    requests = [_request(i, "a") for i in range(3)]
    sent: list[tuple[int, str]] = []
    lock = threading.Lock()

    def send(request: StreamRequest, mode: str) -> ReplayRecord:
        with lock:
            sent.append((request.index, mode))
        return _record(request.index, request.category, mode)

    records = replay(requests, ("auto", "plain", "default"), send)
    orders = [["auto", "plain", "default"], ["plain", "default", "auto"], ["default", "auto", "plain"]]
    assert sent == [(i, m) for i in range(3) for m in orders[i]]  # each mode goes first once
    assert [(r.index, r.mode) for r in records] == sent
    sent.clear()
    concurrent = replay(requests, ("auto", "plain"), send, concurrency=3)
    assert [(r.index, r.mode) for r in concurrent] == [(i, m) for i in range(3)
                                                       for m in (("auto", "plain"), ("plain", "auto"))[i % 2]]
    for i in range(3):  # a request's modes one after another, whatever runs beside them
        mine = [m for j, m in sent if j == i]
        assert mine == [["auto", "plain"], ["plain", "auto"]][i % 2]
    sent.clear()  # a conversation's second turn goes after its first, from the same sender
    talk = _turns("x", "a", 0) + [_request(2, "b")] + _turns("y", "c", 3)
    threads: dict[int, int] = {}

    def send_talk(request: StreamRequest, mode: str) -> ReplayRecord:
        threads[request.index] = threading.get_ident()
        return send(request, mode)

    records = replay(talk, ("auto",), send_talk, concurrency=3)
    assert [r.index for r in records] == [0, 1, 2, 3, 4]
    assert [i for i, _ in sent].index(0) < [i for i, _ in sent].index(1) and threads[0] == threads[1]
    assert [i for i, _ in sent].index(3) < [i for i, _ in sent].index(4) and threads[3] == threads[4]


def test_chosen_forces_what_auto_started_on() -> None:
    """``chosen`` resends a request right after its ``auto`` one with the strategy ``auto`` started
    it on: plain where its controller started plainly, the route's strategy where it started there,
    and nothing where the forced request could not decode the same way."""
    def auto(**kw: Any) -> ReplayRecord:
        base = dict(strategy="default", control_switches=0, control_start="draft-model-10",
                    control_prior="draft-model-10")
        return _record(0, "a", "auto", **{**base, **kw})

    assert forced_mode(auto()) == "default"
    assert forced_mode(auto(strategy="7", control_start="lookup-8", control_prior="lookup-8")) == "7"
    assert forced_mode(auto(control_start="plain")) == "plain"  # a live start: plainly
    assert forced_mode(auto(control_start="lookup-8")) is None  # a moved prior: not forceable by name
    assert forced_mode(auto(control_switches=1)) is None  # switched on the way
    assert forced_mode(auto(state="tuning")) is None
    assert forced_mode(auto(strategy="plain", control_start=None, control_prior=None)) == "plain"  # no controller

    sent: list[tuple[int, str]] = []

    def send(request: StreamRequest, mode: str) -> ReplayRecord:
        sent.append((request.index, mode))
        start = "plain" if request.index == 1 else "draft-model-10"
        return _record(request.index, "a", mode, strategy=mode if mode != "auto" else "default", control_switches=0,
                       control_start=start if mode == "auto" else None, control_prior="draft-model-10")

    records = replay([_request(i, "a") for i in range(2)], parse_modes("auto,chosen,plain"), send)
    # request 1 sends plain first (the order rotates); chosen stays right after auto
    assert sent == [(0, "auto"), (0, "default"), (0, "plain"), (1, "plain"), (1, "auto"), (1, "plain")]
    assert [(r.index, r.mode) for r in records] == [(0, "auto"), (0, "chosen"), (0, "plain"), (1, "plain"),
                                                    (1, "auto"), (1, "chosen")]
    assert send_order(("plain", "auto", CHOSEN, "default"), 2) == ["default", "plain", "auto", CHOSEN]
    with pytest.raises(MethodError, match="list auto before it"):
        parse_modes("chosen,auto")


def test_repeated_rounds_run_backwards_every_second_time_and_count_at_their_median() -> None:
    """``repeat``: a request goes round its modes again, in reverse, so each mode's mean place over
    two rounds is the same; the report takes each mode's median over its rounds, catches a round
    whose tokens differ, and shows a mode's second round against its first."""
    sent: list[tuple[int, str]] = []
    latency = {(0, "plain", 0): 1.0, (0, "plain", 1): 1.4, (1, "plain", 0): 2.0, (1, "plain", 1): 2.0}

    def send(request: StreamRequest, mode: str) -> ReplayRecord:
        round_ = sum(1 for i, m in sent if (i, m) == (request.index, mode))
        sent.append((request.index, mode))
        return _record(request.index, "a" if request.index == 0 else "b", mode, completion_tokens=10,
                       latency_s=latency.get((request.index, mode, round_), 1.0), ttft_s=0.1 * (round_ + 1),
                       tokens_per_s=10.0 / latency.get((request.index, mode, round_), 1.0))

    records = replay([_request(i, "a") for i in range(2)], ("auto", "plain", "default"), send, repeat=2)
    assert sent == [(0, "auto"), (0, "plain"), (0, "default"), (0, "default"), (0, "plain"), (0, "auto"),
                    (1, "plain"), (1, "default"), (1, "auto"), (1, "auto"), (1, "default"), (1, "plain")]
    assert [r.send for r in records] == [0, 0, 0, 1, 1, 1] * 2
    assert send_order(parse_modes("auto,chosen,plain"), 0, 1) == ["plain", "auto", CHOSEN]  # chosen stays after auto
    one = {(r.index, r.mode): r for r in combined(records)}
    assert len(one) == 6 and one[(0, "plain")].latency_s == pytest.approx(1.2)  # median of two: their mean
    assert one[(0, "plain")].tokens_per_s == pytest.approx(10 / 1.2) and one[(0, "plain")].ttft_s == pytest.approx(0.15)
    assert one[(0, "auto")].latency_s == pytest.approx(1.0) and one[(0, "auto")].send == 0
    spread = repeat_spread(records, ("auto", "plain", "default"))
    assert spread["plain"] == {"a": pytest.approx(1.4), "b": pytest.approx(1.0), "all": pytest.approx(3.4 / 3.0)}
    assert spread["auto"]["all"] == pytest.approx(1.0)
    assert repeat_spread([r for r in records if r.send == 0], ("plain",)) is None
    report = aggregate(records, ("auto", "plain", "default"))
    assert row(report, "a", "plain")["requests"] == 1 and row(report, "all", "plain")["decode_s"] == pytest.approx(3.2)
    assert report["identical"]["differ"] == 0
    assert "plain, second round / first (latency): 1.000-1.400 per category, 1.133 over all" in format_table(report)
    # a second round that answered other tokens is a differing request, though its first round agreed
    changed = [replace(r, token_ids=(9,)) if (r.index, r.mode, r.send) == (1, "auto", 1) else r for r in records]
    assert identical(changed, ("auto", "plain", "default"))["differing"] == [1]


def test_the_interval_of_a_mode_over_plain_tells_a_steady_loss_from_noise() -> None:
    """``vs_plain_intervals``: a paired bootstrap over the requests, holding each category's own
    ratio. Power: twelve requests that each ran 0.8x plain (5% spread) give an interval wholly
    below 1; twelve at plain's speed with 25% spread give one over twice as wide."""
    import random

    from autotune.reports.replay_report import vs_plain_intervals

    rnd = random.Random(1)
    records = []
    for i in range(24):
        category, speed, spread = ("steady", 0.8, 0.05) if i < 12 else ("noisy", 1.0, 0.25)
        plain_tps = 10.0 * (1 + rnd.uniform(-spread, spread))
        records.append(_record(i, category, "plain", tokens_per_s=plain_tps))
        records.append(_record(i, category, "auto", tokens_per_s=plain_tps * speed * (1 + rnd.uniform(-spread, spread))))
    got = vs_plain_intervals(records, ("auto", "plain"))
    steady, noisy = got["auto"]["steady"], got["auto"]["noisy"]
    report = aggregate(records, ("auto", "plain"))
    for category, (low, high) in got["auto"].items():  # each holds its own point figure
        point = row(report, category, "auto")["tokens_per_s"] / row(report, category, "plain")["tokens_per_s"]
        assert low < point < high
    assert steady[1] < 1.0 and noisy[1] - noisy[0] > 2 * (steady[1] - steady[0])
    assert vs_plain_intervals(records, ("auto", "plain")) == got  # seeded
    assert vs_plain_intervals(records, ("auto",)) is None  # nothing to compare with
    assert vs_plain_intervals([r for r in records if r.mode == "plain"], ("auto", "plain")) == {"auto": {}}
    assert report["vs_plain_intervals"] == got
    assert f"lowest category steady {steady[0]:.3f}-{steady[1]:.3f}" in format_table(report)
    rows = json.loads(json.dumps([r.as_dict() for r in records]))  # a --json file's records, read back
    assert vs_plain_intervals([ReplayRecord.from_dict(r) for r in rows], ("auto", "plain")) == got


def test_length_bands_and_auto_beside_its_choice() -> None:
    records = [
        _record(0, "qa", "auto", completion_tokens=12, tokens_per_s=10.0, latency_s=1.00, ttft_s=0.2),
        _record(0, "qa", "chosen", completion_tokens=12, tokens_per_s=10.0, latency_s=0.99, ttft_s=0.2),
        _record(0, "qa", "plain", completion_tokens=12, tokens_per_s=12.0, latency_s=0.9),
        _record(1, "code", "auto", completion_tokens=90, tokens_per_s=30.0, latency_s=3.0, ttft_s=0.3, drafted=40,
                accepted=30),
        _record(1, "code", "chosen", completion_tokens=90, tokens_per_s=30.0, latency_s=3.3, ttft_s=0.3, drafted=40,
                accepted=29),
        _record(1, "code", "plain", completion_tokens=90, tokens_per_s=10.0, latency_s=9.0),
    ]
    rows = {(r["band"], r["mode"]): r for r in bands(records, ("auto", "chosen", "plain"))}
    assert set(rows) == {(b, m) for b in ("<=32", "33-96") for m in ("auto", "chosen", "plain")}
    assert rows[("<=32", "auto")]["vs_plain"] == pytest.approx(10 / 12)
    assert rows[("33-96", "auto")]["vs_plain"] == pytest.approx(3.0)
    f = forced(records)
    assert f["<=32"]["latency_ratio"] == pytest.approx(0.99) and f["<=32"]["same_drafting"] == 1
    assert f["33-96"]["same_drafting"] == 0 and f["33-96"]["same_drafting_latency_ratio"] is None
    assert f["all"]["latency_ratio"] == pytest.approx(4.29 / 4.0) and f["all"]["pairs"] == 2
    assert forced([r for r in records if r.mode != "chosen"]) is None
    report = aggregate(records, ("auto", "chosen", "plain"))
    assert report["identical"]["differ"] == 0 and report["forced"] == f
    text = format_table(report)
    assert "<=32 tokens, auto" in text and "latency ratio 0.990" in text


def test_modes_and_urls() -> None:
    assert parse_modes("auto, plain,12") == ("auto", "plain", "12")
    for bad, needle in [("auto,fast", "unknown mode 'fast'"), ("auto,auto", "listed twice"), (" , ", "comma list")]:
        with pytest.raises(MethodError, match=needle):
            parse_modes(bad)
    assert base_url("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000"
    with pytest.raises(SettingError, match="--url must be an http"):
        base_url("127.0.0.1:8000")
    with pytest.raises(SettingError, match="concurrency must be at least 1"):
        ReplaySettings(url="http://x", concurrency=0)


def test_aggregate_math() -> None:
    records = [
        _record(0, "code", "auto", completion_tokens=20, tokens_per_s=40.0, drafted=12, accepted=9, draft_rounds=3),
        _record(1, "code", "auto", completion_tokens=10, tokens_per_s=20.0, drafted=8, accepted=3, draft_rounds=2,
                strategy="tuning", state="tuning", route="other"),
        _record(2, "chat", "auto", completion_tokens=30, tokens_per_s=30.0),
        *[_record(i, c, "plain", completion_tokens=n, tokens_per_s=10.0)
          for i, c, n in ((0, "code", 20), (1, "code", 10), (2, "chat", 30))],
    ]
    report = aggregate(records, ("auto", "plain"), {"code": 1, "chat": 0})
    assert report["categories"] == ["code", "chat"] and len(report["rows"]) == 6
    code = row(report, "code", "auto")
    assert code["requests"] == 2 and code["completion_tokens"] == 30
    assert code["decode_s"] == pytest.approx(0.5 + 0.5) and code["tokens_per_s"] == pytest.approx(30.0)
    assert code["acceptance"] == pytest.approx(12 / 20) and code["mean_accepted"] == pytest.approx((12 + 5) / 5)
    assert code["route"] == "code" and code["routes"] == {"code": 1, "other": 1}
    assert code["switches"] == 1 and code["tuning_requests"] == 1
    assert row(report, "chat", "auto")["mean_accepted"] == 1.0  # nothing drafted
    everything = row(report, "all", "auto")
    assert everything["tokens_per_s"] == pytest.approx(60 / 2.0) and everything["switches"] == 1
    assert row(report, "all", "plain")["tokens_per_s"] == pytest.approx(10.0)
    # after the first token: (20 - 1 + 10 - 1) tokens over 2 x (1.0 - 0.05) s, the prefill left out
    assert code["after_first_tokens_per_s"] == pytest.approx(28 / 1.9)
    assert report["identical"] == {"requests": 3, "modes": ["auto", "plain"], "differ": 0, "differing": []}
    assert report["route_retunes"] == {"code": 1, "chat": 0}
    table = format_table(report)
    assert "identical across auto, plain on all 3 requests" in table and "code 1" in table


def test_switches_count_label_changes_per_category() -> None:
    labels = ["3", "3", "plain", "tuning", "tuning", "5"]
    records = [_record(i, "a", "auto", strategy=s) for i, s in enumerate(labels)]
    records += [_record(10 + i, "b", "auto", strategy=s) for i, s in enumerate(["1", "2"])]
    assert switches(records) == 3 + 1
    assert switches(list(reversed(records))) == 4  # ordered by stream index, not by arrival


def test_controller_figures_per_category() -> None:
    """Controlled requests: the share whose controller switched, their final strategies, and the
    controller's scoring time over their decode time; uncontrolled modes report none."""
    auto = [_record(0, "a", "auto", control_switches=0, control_final="lookup-8", control_s=0.01),
            _record(1, "a", "auto", control_switches=2, control_final="plain", control_s=0.03)]
    report = aggregate(auto + [_record(i, "a", "plain") for i in (0, 1)], ["auto", "plain"])
    got = row(report, "a", "auto")
    assert got["controlled"] == 2 and got["controller_switched"] == 0.5
    assert got["controller_finals"] == {"lookup-8": 1, "plain": 1}
    assert got["controller_share"] == pytest.approx(0.04 / 2.0)  # 2 x 10 tokens at 10 tok/s
    assert row(report, "a", "plain")["controller_switched"] is None
    assert "50%" in format_table(report) and "2.00%" in format_table(report)
    body = {"usage": {"completion_tokens": 3}, "autotune": {
        "route": "a", "strategy": "3", "drafted": 0, "accepted": 0, "draft_rounds": 0, "tokens_per_s": 1.0,
        "ttft_s": 0.1, "latency_s": 1.0, "token_ids": [1, 2, 3],
        "control": {"switches": 1, "final": "plain", "scoring_s": 0.5, "prior": "lookup-8"}}}
    parsed = ReplayRecord.from_response(_request(0, "a"), "auto", body)
    assert (parsed.control_switches, parsed.control_final, parsed.control_s) == (1, "plain", 0.5)
    del body["autotune"]["control"]
    assert ReplayRecord.from_response(_request(0, "a"), "auto", body).control_switches is None
    body["autotune"]["tuning"] = {"tuning_s": 0.25, "trials": 3, "swept": 10, "request": 1}  # a re-tune's request
    assert ReplayRecord.from_response(_request(0, "a"), "auto", body).tuning_s == 0.25


def test_pending_clusters_are_scored_against_the_categories() -> None:
    """The adjusted Rand index of the clusters the server's responses named against the stream's
    categories; requests that joined none (routed, or no --adaptive) are left out."""
    records = [_record(i, c, "auto", cluster=k) for i, (c, k) in enumerate(
        [("xsum", 0), ("nq", 1), ("xsum", 0), ("nq", 1), ("xsum", 0)])]
    records.append(_record(9, "humaneval", "auto"))  # routed: no cluster
    got = clustering(records)
    assert got is not None and got["ari"] == pytest.approx(1.0) and got["requests"] == 5 and got["clusters"] == 2
    assert got["by_category"] == {"xsum": [0], "nq": [1]}
    mixed = [_record(i, c, "auto", cluster=k) for i, (c, k) in enumerate(
        [("xsum", 0), ("nq", 0), ("xsum", 1), ("nq", 1), ("xsum", 2), ("nq", 2)])]
    assert clustering(mixed)["ari"] < 0.2  # clusters that ignore the categories
    assert clustering([_record(0, "a", "auto")]) is None
    report = aggregate(records, ["auto"])
    assert report["clustering"]["ari"] == pytest.approx(1.0)
    assert "adjusted Rand index 1.000" in format_table(report)
    # a studied category whose requests routed to unknown, each its own cluster: the unseen figure leaves it out
    studied = records + [_record(10 + i, "mt-bench", "auto", cluster=5 + i) for i in range(3)]
    report = aggregate(studied, ["auto"], stored_tasks=["mt-bench", "humaneval"])
    got = report["clustering"]
    assert got["ari"] < 1.0 and got["categories"] == 3
    assert got["unseen"]["ari"] == pytest.approx(1.0) and got["unseen"]["requests"] == 5
    assert "categories no stored task is named after: 1.000" in format_table(report)
    without = clustering(studied)  # no stored tasks known (a server that does not report them)
    assert without["ari"] == got["ari"] and "unseen" not in without
    body = {"usage": {"completion_tokens": 3}, "autotune": {
        "route": "unknown", "strategy": "plain", "drafted": 0, "accepted": 0, "draft_rounds": 0,
        "tokens_per_s": 1.0, "ttft_s": 0.1, "latency_s": 1.0, "token_ids": [1, 2, 3], "cluster": 4}}
    assert ReplayRecord.from_response(_request(0, "a"), "auto", body).cluster == 4


def test_identical_check() -> None:
    records = [_record(i, "a", m) for i in range(3) for m in ("auto", "plain")]
    records[3] = _record(1, "a", "plain", token_ids=(1, 2, 4))
    records.append(_record(3, "b", "auto"))  # no plain answer for request 3
    same = identical(records, ("auto", "plain"))
    assert same["differ"] == 2 and same["differing"] == [1, 3]
    report = aggregate(records, ("auto", "plain"))
    assert row(report, "a", "plain")["differ"] == 1 and row(report, "all", "auto")["differ"] == 2
    assert "2 of 4 requests DIFFER" in format_table(report)


def test_plot_writes_a_png(tmp_path: Path) -> None:
    records = [_record(i, c, m, tokens_per_s=10.0 + i + (5 if m == "auto" else 0))
               for i, c in enumerate(["code"] * 3 + ["chat"] * 2 + ["code"] * 3) for m in ("auto", "plain")]
    assert category_bands(records) == [("code", 0, 2), ("chat", 3, 4), ("code", 5, 7)]
    path = replay_plot(records, ("auto", "plain"), tmp_path / "plots" / "stream.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    from matplotlib.image import imread

    pixels = imread(path)
    assert pixels.shape[0] > 300 and pixels.shape[1] > 800 and pixels.std() > 0.05
    empty = replay_plot([], ("auto",), tmp_path / "empty.png")
    assert empty.read_bytes()[:4] == b"\x89PNG"


# ---------------------------------------------------------------------- the command, on a fake server
def fake_server(differ_mode: str | None = None, health_routes: dict | None = None) -> httpx.MockTransport:
    """Answers like `autotune serve`: token ids from the prompt (changed in ``differ_mode``)."""

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "fake-model"}]})
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok", **({"routes": health_routes} if health_routes else {})})
        body = json.loads(request.content)
        assert body["temperature"] == 0 and body["model"] == "fake-model"
        mode = body["autotune"]["strategy"]
        assert body["autotune"]["return_token_ids"] is True
        content = body["messages"][-1]["content"]
        ids = [len(content), body["max_tokens"]] + ([99] if mode == differ_mode else [])
        info = {"route": content.split()[0], "distance": 0.0, "strategy": "plain" if mode == "plain" else "4",
                "state": "stored", "drafted": 6, "accepted": 4, "draft_rounds": 2, "mean_accepted": 3.0,
                "tokens_per_s": 50.0 if mode == "auto" else 25.0, "ttft_s": 0.01, "latency_s": 0.1, "token_ids": ids}
        return httpx.Response(200, json={"choices": [{"message": {"content": "x"}}], "autotune": info,
                                         "usage": {"completion_tokens": len(ids)}})

    return httpx.MockTransport(handle)


@pytest.fixture
def stream_file(tmp_path: Path) -> Path:
    requests = [_request(i, c) for i, c in enumerate(["code", "code", "chat", "chat"])]
    return write_stream(requests, tmp_path / "stream.jsonl")


@pytest.fixture
def quiet_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(autotune.cli.main, "_quiet_libraries", lambda: None)  # no transformers import needed here


def _use_fake(monkeypatch: pytest.MonkeyPatch, transport: httpx.MockTransport) -> None:
    class FakeClient(ReplayClient):
        def __init__(self, settings: ReplaySettings) -> None:
            super().__init__(settings, transport=transport)

    monkeypatch.setattr(autotune.cli.replay, "ReplayClient", FakeClient)


def test_command_on_fake_server(tmp_path: Path, stream_file: Path, monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str], quiet_cli: None) -> None:
    _use_fake(monkeypatch, fake_server(health_routes={"code": {"retunes": 2}}))
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    code = autotune.cli.main.main(["replay", "--stream", str(stream_file), "--url", "http://fake:1", "--max-tokens", "7",
                              "--json", str(out), "--plot", str(png), "--concurrency", "2"])
    printed = capsys.readouterr().out
    assert code == 0 and "identical across auto, plain, default on all 4 requests" in printed
    assert "server re-tunes per route: code 2" in printed
    report = json.loads(out.read_text())
    assert report["config"]["model"] == "fake-model" and report["config"]["requests"] == 4
    assert len(report["records"]) == 12 and report["records"][0]["token_ids"] == [len("code question 0"), 7]
    auto = row(report, "all", "auto")
    assert auto["tokens_per_s"] == pytest.approx(50.0) and auto["mean_accepted"] == pytest.approx(3.0)
    assert row(report, "chat", "plain")["route"] == "chat" and png.stat().st_size > 10_000


def test_command_repeats_each_requests_modes(stream_file: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str], quiet_cli: None) -> None:
    _use_fake(monkeypatch, fake_server())
    out = tmp_path / "r.json"
    code = autotune.cli.main.main(["replay", "--stream", str(stream_file), "--url", "http://fake:1", "--repeat", "2",
                                   "--mode", "auto,plain", "--json", str(out)])
    assert code == 0 and "plain, second round / first (latency): 1.000-1.000 per category" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["config"]["repeat"] == 2 and len(report["records"]) == 16
    assert sorted(r["send"] for r in report["records"]) == [0] * 8 + [1] * 8 and row(report, "all", "auto")["requests"] == 4


def test_command_exit_1_when_outputs_differ(stream_file: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str], quiet_cli: None) -> None:
    _use_fake(monkeypatch, fake_server(differ_mode="plain"))
    code = autotune.cli.main.main(["replay", "--stream", str(stream_file), "--url", "http://fake:1", "--limit", "3",
                              "--mode", "auto,plain"])
    assert code == 1 and "3 of 3 requests DIFFER" in capsys.readouterr().out


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str], *needles: str) -> None:
    code, _, err = run(capsys, *argv)
    assert_one_line_error(code, err, *needles)


@pytest.mark.parametrize(
    "extra,needles",
    [
        (["--stream", "mixd"], ["unknown stream 'mixd'", "mixed"]),
        (["--stream", "/nonexistent/stream.jsonl"], ["unknown stream '/nonexistent/stream.jsonl'"]),
        (["--stream", "mixed", "--tasks", "humaneval,gsm9k"], ["unknown task 'gsm9k'"]),
        (["--stream", "STREAM", "--mode", "auto,turbo"], ["unknown mode 'turbo'"]),
        (["--stream", "STREAM", "--limit", "0"], ["--limit must be at least 1"]),
        (["--stream", "STREAM", "--repeat", "0"], ["repeat must be at least 1, got 0"]),
        (["--stream", "STREAM", "--block", "2"], ["only apply to a named stream"]),
        (["--stream", "STREAM", "--url", "ftp://x"], ["--url must be an http(s) URL"]),
        (["--stream", "STREAM", "--url", "http://127.0.0.1:9"], ["cannot reach autotune serve at http://127.0.0.1:9"]),
    ],
)
def test_bad_input_one_line_exit_2(extra: list[str], needles: list[str], stream_file: Path,
                                   capsys: pytest.CaptureFixture[str], quiet_cli: None) -> None:
    args = [str(stream_file) if a == "STREAM" else a for a in extra]
    if "--url" not in args:
        args += ["--url", "http://127.0.0.1:9"]
    _one_line_error(capsys, ["replay", *args], *needles)


def test_bad_server_answer(stream_file: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                           quiet_cli: None) -> None:
    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        return httpx.Response(400, json={"error": {"message": "'max_tokens': too many"}})

    _use_fake(monkeypatch, httpx.MockTransport(handle))
    _one_line_error(capsys, ["replay", "--stream", str(stream_file), "--url", "http://fake:1"],
                    "request 0 (code/0, mode auto) answered HTTP 400: 'max_tokens': too many")


def test_not_json_answer(stream_file: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                         quiet_cli: None) -> None:
    _use_fake(monkeypatch, httpx.MockTransport(lambda request: httpx.Response(200, text="<html>hello</html>")))
    _one_line_error(capsys, ["replay", "--stream", str(stream_file), "--url", "http://fake:1/v1"],
                    "GET http://fake:1/v1/models answered with something other than JSON")


# ---------------------------------------------------------------------- slow: a real server
@pytest.mark.slow
# heavy: a server start-up of its own for the replay client; replay's identity check against a live server stays in
# the default run (tests/autotune/test_first_turns.py), and over fake servers here
@pytest.mark.heavy
def test_replay_against_real_server(pool, smollm, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from autotune.serving.server import ServeConfig, build_server
    from autotune.store.records import ResultMetrics
    from autotune.store.resolve import strategy_key
    from autotune.store.storage import open_storage
    from search_spaces.layer_plan import uniform_skip_plan
    from search_spaces.strategy import Strategy
    from studies import load_prompts, routing_text

    url = f"sqlite:///{tmp_path / 'store.db'}"
    n = smollm.hf_model.config.num_hidden_layers
    tuned = {"gsm8k": Strategy(drafter="layer-skip", draft_length=4, layer_plan=uniform_skip_plan(n, 0.2)),
             "humaneval": Strategy(drafter="prompt-lookup", draft_length=6)}
    out, png = tmp_path / "replay.json", tmp_path / "replay.png"
    with open_storage(url) as storage:
        for task, strategy in tuned.items():
            texts = [routing_text(p) for p in load_prompts(task, None, 12)]
            storage.record(strategy_key(smollm, None, task, "cpu"), strategy, ResultMetrics.from_throughput(20.0),
                           prompts=texts)
        server = build_server(ServeConfig(model="smollm2-135m", storage=url), storage, pool=pool)
        with LiveServer(server) as live:
            code = autotune.cli.main.main([
                "replay", "--stream", "mixed", "--tasks", "gsm8k,humaneval", "--block", "2", "--blocks-per-task", "1",
                "--url", live.url, "--mode", "auto,plain", "--max-tokens", "12", "--json", str(out), "--plot", str(png),
            ])
    printed = capsys.readouterr().out
    assert code == 0, printed
    report = json.loads(out.read_text())
    assert report["identical"] == {"requests": 4, "modes": ["auto", "plain"], "differ": 0, "differing": []}
    assert sorted(report["categories"]) == ["gsm8k", "humaneval"] and len(report["records"]) == 8
    assert len(report["rows"]) == 3 * 2  # two categories and all, each in both modes
    for task in tuned:
        auto, plain = row(report, task, "auto"), row(report, task, "plain")
        assert auto["requests"] == plain["requests"] == 2
        assert auto["route"] == task and set(auto["strategies"]) != {"plain"} and auto["switches"] == 0
        assert set(plain["strategies"]) == {"plain"} and plain["drafted"] == 0
        assert auto["tokens_per_s"] > 0 and plain["tokens_per_s"] > 0 and auto["completion_tokens"] > 0
    assert all(len(r["token_ids"]) <= 12 for r in report["records"])
    assert "identical across auto, plain on all 4 requests" in printed and png.stat().st_size > 10_000
