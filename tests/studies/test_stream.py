"""Request streams: the shifting `mixed` workload and stream files (JSONL)."""
from __future__ import annotations

import itertools
import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from studies import (
    DATA_DIR_ENV,
    DEFAULT_MIXED_TASKS,
    Prompt,
    StreamRequest,
    TaskError,
    load_prompts,
    load_stream,
    mixed_stream,
    read_stream,
    write_stream,
)
from studies.stream import round_orders

SHARED_DATA = Path(os.environ.get(DATA_DIR_ENV) or Path(__file__).resolve().parents[3] / "shared" / "data")
LIGHT = ("humaneval", "mt-bench", "nq-open", "asdiv")  # packaged, no GSM8K folder needed


def _runs(stream: list[StreamRequest]) -> list[tuple[str, int]]:
    return [(category, len(list(group))) for category, group in itertools.groupby(r.category for r in stream)]


def test_block_structure_and_rounds() -> None:
    stream = mixed_stream(LIGHT, block=2, blocks_per_task=3, offset=5, seed=1)
    assert [r.index for r in stream] == list(range(24))
    runs = _runs(stream)
    assert runs == [(c, 2) for c, _ in runs] and len(runs) == 12  # every boundary is a shift (4 tasks)
    rounds = [tuple(c for c, _ in runs[i:i + 4]) for i in range(0, 12, 4)]
    assert all(sorted(order) == sorted(LIGHT) for order in rounds)  # each round: one block of every task
    assert rounds[0] != rounds[1] and rounds[1] != rounds[2]  # the order shifts between rounds


def test_prompts_in_order_from_offset_never_repeated() -> None:
    stream = mixed_stream(LIGHT, block=2, blocks_per_task=2, offset=3)
    assert len({r.prompt.id for r in stream}) == len(stream)
    for name in LIGHT:
        taken = [r.prompt for r in stream if r.category == name]
        assert taken == load_prompts(name, limit=4, offset=3)


def test_seeded_and_deterministic() -> None:
    one = mixed_stream(LIGHT, block=1, blocks_per_task=3, seed=7)
    assert one == mixed_stream(LIGHT, block=1, blocks_per_task=3, seed=7)
    others = [mixed_stream(LIGHT, block=1, blocks_per_task=3, seed=s) for s in range(8, 12)]
    assert any([r.category for r in o] != [r.category for r in one] for o in others)


@pytest.mark.parametrize("n,seed", [(2, 0), (3, 1), (6, 2), (6, 3)])
def test_round_orders_shift(n: int, seed: int) -> None:
    tasks = [f"t{i}" for i in range(n)]
    orders = round_orders(tasks, 20, seed)
    for last, order in zip(orders, orders[1:]):
        assert sorted(order) == tasks and order != last
        if n >= 3:
            assert order[0] != last[-1]


def test_default_mixed_tasks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DATA_DIR_ENV, str(SHARED_DATA))
    stream = mixed_stream(block=1, blocks_per_task=2, offset=0)
    assert DEFAULT_MIXED_TASKS == ("humaneval", "gsm8k", "mt-bench", "xsum", "nq-open", "asdiv", "translation")
    assert sorted({r.category for r in stream}) == sorted(DEFAULT_MIXED_TASKS) and len(stream) == 14
    assert all(r.prompt.messages for r in stream)
    assert load_stream("mixed", tasks=("asdiv",), block=2, blocks_per_task=1)[1].prompt.id == "asdiv/22"  # offset 20


def test_mixed_errors(tmp_path: Path) -> None:
    with pytest.raises(TaskError, match="unknown task 'gsm9k'"):
        mixed_stream(("humaneval", "gsm9k"), block=1)
    with pytest.raises(TaskError, match="'asdiv' is listed twice"):
        mixed_stream(("asdiv", "asdiv"))
    with pytest.raises(TaskError, match="block must be at least 1, got 0"):
        mixed_stream(LIGHT, block=0)
    with pytest.raises(TaskError, match="offset must be 0 or more"):
        mixed_stream(LIGHT, offset=-1)
    with pytest.raises(TaskError, match="task 'mt-bench' has 2 prompts from offset 78, the stream needs 4"):
        mixed_stream(("mt-bench",), block=2, blocks_per_task=2, offset=78)
    data = tmp_path / "mine.jsonl"
    data.write_text('{"question": "q", "answer": "a"}\n')
    (only,) = mixed_stream(("nq-open",), block=1, blocks_per_task=1, offset=0, data={"nq-open": data})
    assert only.prompt.reference == "a"


def test_round_trip(tmp_path: Path) -> None:
    stream = mixed_stream(("humaneval", "asdiv"), block=2, blocks_per_task=1)
    path = write_stream(stream, tmp_path / "out" / "stream.jsonl")
    back = read_stream(path)
    assert [(r.index, r.category, r.prompt.id, r.prompt.messages) for r in back] == \
        [(r.index, r.category, r.prompt.id, r.prompt.messages) for r in stream]
    assert load_stream(str(path)) == back
    row = json.loads(path.read_text().splitlines()[0])
    assert set(row) == {"id", "category", "messages"} and row["messages"][0][0] == "user"
    talk = [replace(r, conversation="c1") for r in stream[:2]] + stream[2:]  # a conversation's turns round-trip
    back = read_stream(write_stream(talk, tmp_path / "talk.jsonl"))
    assert [r.conversation for r in back] == ["c1", "c1"] + [None] * (len(stream) - 2)


def test_prompt_rows_and_ids(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    path.write_text('{"category": "chat", "prompt": "hi"}\n\n'
                    '{"category": "code", "id": 9, "messages": [["system", "be brief"], ["user", "go"]]}\n')
    first, second = read_stream(path)
    assert first == StreamRequest(0, "chat", Prompt(id="chat/1", messages=(("user", "hi"),), text="hi"))
    assert second.index == 1 and second.prompt.id == "9" and second.prompt.messages == (("system", "be brief"), ("user", "go"))


@pytest.mark.parametrize(
    "line,needle",
    [
        ('{"prompt": "x"}', "field 'category' is missing"),
        ('{"category": "c"}', "row has neither 'messages' nor 'prompt'"),
        ('{"category": "c", "messages": [["user"]]}', "'messages' must be a non-empty list of \\[role, content\\]"),
        ('{"category": "c", "messages": []}', "'messages' must be a non-empty list"),
        ('{"category": "c", "prompt": ""}', "field 'prompt' is missing or not a non-empty string"),
        ('{"category": "c", "prompt": "p", "conversation": 3}', "field 'conversation' is missing or not a non-empty"),
        ('[1, 2]', "expected a JSON object"),
        ('{"category": ', "malformed JSON"),
    ],
)
def test_bad_lines_name_the_line(tmp_path: Path, line: str, needle: str) -> None:
    path = tmp_path / "s.jsonl"
    path.write_text('{"category": "ok", "prompt": "fine"}\n' + line + "\n")
    with pytest.raises(TaskError, match=f"s.jsonl:2: {needle}"):
        read_stream(path)


def test_stream_spec_errors(tmp_path: Path) -> None:
    with pytest.raises(TaskError, match="unknown stream 'mixd': not one of mixed, multi-turn and no such file"):
        load_stream("mixd")
    with pytest.raises(TaskError, match="unknown stream .*nowhere.jsonl"):
        load_stream(str(tmp_path / "nowhere.jsonl"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(TaskError, match="holds no requests"):
        load_stream(str(empty))
    with pytest.raises(TaskError, match="block only apply to a named stream"):
        load_stream(str(empty), block=2)
    with pytest.raises(TaskError, match="is a folder"):
        load_stream(str(tmp_path))
