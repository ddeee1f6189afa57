"""The `multi-turn` stream's first-turn answers (greedy plain decoding on SmolLM2-135M) and its
command-line wiring in `autotune replay` / `autotune loadtest`; slow: a live server answers each
first turn with the cached answer, and a replay of the stream is identical across modes."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from autotune.errors import SettingError
from autotune.measure.first_turns import AnswerSettings, PlainAnswerer
from runtime.decoding import GenerationConfig
from runtime.errors import RuntimeUserError
from runtime.pipeline import build_decoder, eos_ids
from search_spaces.strategy import PLAIN
from studies import AnswerKey, Prompt, encode_prompt, multi_turn_stream
from tests.helpers import LiveServer, assert_one_line_error, run

SMOL = AnswerSettings(model="smollm2-135m", precision="float32", max_tokens=12)


def test_answers_are_greedy_plain_decoding_and_deterministic(pool, smollm, tmp_path: Path) -> None:
    short = AnswerSettings(model="smollm2-135m", precision="float32", max_tokens=8)
    stream = multi_turn_stream(PlainAnswerer(short, pool), tmp_path, questions=1, log=lambda line: None,
                               first_turns=False)
    (_, first), (_, answer), _ = stream[0].prompt.messages
    # decoded again, apart: the same text (deterministic), and what `autotune generate` and the server
    # (tests/autotune/test_serve.py) answer to that first turn
    ids = encode_prompt(Prompt(id="q", messages=(("user", first),)), smollm.tokenizer)  # as the server encodes it
    out = build_decoder(pool, smollm, PLAIN).generate(ids, GenerationConfig(max_new_tokens=8,
                                                                              eos_token_ids=eos_ids(smollm)))
    assert answer == smollm.tokenizer.decode(out.tokens, skip_special_tokens=True) and answer.strip()


def test_key_resolves_auto_without_loading(no_model_loads) -> None:
    key = AnswerSettings(model="smollm2-135m").key()
    assert key == AnswerKey("smollm2-135m", "int4", 96, "cpu")  # the suite pins auto to int4
    assert AnswerSettings().model == "qwen2.5-coder-1.5b"
    with pytest.raises(RuntimeUserError, match="unknown model 'nosuch'"):
        AnswerSettings(model="nosuch").key()
    with pytest.raises(SettingError, match="at least 1 token"):
        AnswerSettings(max_tokens=0)


# ---------------------------------------------------------------------- the command line
@dataclass
class Scripted:
    """Stands in for PlainAnswerer in the CLI: answers without a model, records its settings."""

    settings: AnswerSettings
    asked: list[str] = field(default_factory=list)

    @property
    def key(self) -> AnswerKey:
        return self.settings.key()

    def answer(self, prompt: Prompt) -> str:
        self.asked.append(prompt.id)
        return f"answer to {prompt.id}"


@pytest.fixture
def scripted(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Scripted]:
    import autotune.measure.first_turns

    made: list[Scripted] = []

    def make(settings: AnswerSettings) -> Scripted:
        made.append(Scripted(settings))
        return made[-1]

    monkeypatch.setattr(autotune.measure.first_turns, "PlainAnswerer", make)
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path / "cache"))
    return made


@pytest.mark.parametrize("command", ["replay", "loadtest"])
def test_the_flags_reach_the_stream_and_the_cache(command: str, scripted: list[Scripted], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from autotune.cli.main import build_parser
    from autotune.cli.replay import stream_config, stream_from_args

    argv = [command, "--url", "http://127.0.0.1:9", "--stream", "multi-turn", "--questions", "4", "--limit", "3",
            "--answer-model", "smollm2-135m", "--answer-precision", "float32", "--answer-tokens", "20"]
    args = build_parser().parse_args(argv)
    requests = stream_from_args(args)
    assert len(requests) == 3 and [len(r.prompt.messages) for r in requests] == [1, 3, 1]  # turn 1, 2, then 1
    assert scripted[0].settings == AnswerSettings(model="smollm2-135m", precision="float32", max_tokens=20)
    assert len(scripted[0].asked) == 4  # the stream's questions, then cut to --limit
    cached = list((tmp_path / "cache" / "streams").glob("multi-turn-smollm2-135m-float32-20-*.json"))
    assert len(cached) == 1
    assert "answering 4 MT-Bench first turns" in capsys.readouterr().err
    assert stream_config(args) == {"questions": 4, "answer_model": "smollm2-135m", "answer_precision": "float32",
                                   "answer_tokens": 20}
    assert stream_from_args(args) == requests and len(scripted[1].asked) == 0  # the second time: the cache


@pytest.mark.parametrize(
    "extra,needles",
    [
        (["--stream", "mixed", "--questions", "4"], ["--questions applies to --stream multi-turn, not mixed"]),
        (["--stream", "multi-turn", "--questions", "0"], ["at least 1 question"]),
        (["--stream", "multi-turn", "--questions", "81"], ["MT-Bench has 80"]),
        (["--stream", "multi-turn", "--answer-tokens", "0"], ["at least 1 token"]),
        (["--stream", "multi-turn", "--answer-model", "nosuch"], ["unknown model 'nosuch'"]),
        (["--stream", "multi-turn", "--answer-precision", "int3"], ["int3"]),
    ],
)
@pytest.mark.parametrize("command", ["replay", "loadtest"])
def test_bad_multi_turn_input_one_line_exit_2(command: str, extra: list[str], needles: list[str], no_model_loads,
                                              tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path))
    code, _, err = run(capsys, command, "--url", "http://127.0.0.1:9", *extra)
    assert_one_line_error(code, err, *needles)
    assert not (tmp_path / "streams").exists()


def test_a_mixed_flag_with_the_multi_turn_stream_is_refused(no_model_loads, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "replay", "--url", "http://127.0.0.1:9", "--stream", "multi-turn", "--block", "2")
    assert_one_line_error(code, err, "--block applies to --stream mixed, not multi-turn")


# ---------------------------------------------------------------------- slow: a live server
@pytest.mark.slow
def test_the_server_answers_the_first_turn_as_cached_and_replays_identically(
        pool, smollm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from autotune.serving.server import ServeConfig, build_server
    from autotune.store.storage import open_storage
    from studies.multi_turn import cache_path

    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path / "cache"))
    stream = multi_turn_stream(PlainAnswerer(SMOL, pool), tmp_path / "cache", questions=2, log=lambda line: None,
                               first_turns=False)
    out = tmp_path / "replay.json"
    with open_storage(f"sqlite:///{tmp_path / 'store.db'}") as storage:
        config = ServeConfig(model="smollm2-135m", storage=f"sqlite:///{tmp_path / 'store.db'}", max_batch=1,
                             request_control=False)  # a quick start-up: one slot, no controller cost models
        server = build_server(config, storage, pool=pool)
        with LiveServer(server) as live:
            for request in stream:
                first, answer = request.prompt.messages[0], request.prompt.messages[1]
                body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": first[1]}],
                        "max_tokens": SMOL.max_tokens, "temperature": 0}
                got = httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=120).json()
                assert got["choices"][0]["message"]["content"] == answer[1]  # what our server answers
            code, printed, err = run(capsys, "replay", "--stream", "multi-turn", "--questions", "2", "--url", live.url,
                                     "--answer-model", "smollm2-135m", "--answer-precision", "float32",
                                     "--answer-tokens", str(SMOL.max_tokens), "--mode", "plain,default",
                                     "--max-tokens", "6", "--json", str(out))
    assert code == 0, printed + err
    assert "answering" not in err  # read from the cache the stream above wrote
    report = json.loads(out.read_text())
    assert report["identical"]["requests"] == 4 and report["identical"]["differ"] == 0  # both turns of 2
    assert sorted(report["categories"]) == sorted({r.category for r in stream})
    assert cache_path(tmp_path / "cache", SMOL.key()).exists()
