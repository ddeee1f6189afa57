"""The `prompts` task (your own JSONL) and JSONL error reporting."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from studies import TaskError, load_prompts


def _write(path: Path, *lines: str) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_three_row_shapes(tmp_path: Path) -> None:
    data = _write(
        tmp_path / "mine.jsonl",
        json.dumps({"prompt": "Once upon a time"}),
        "",
        json.dumps({"id": "q1", "question": "Why is the sky blue?"}),
        json.dumps({"question_id": 9, "turns": ["First turn", "Second turn"]}),
    )
    raw, question, turns = load_prompts("prompts", data)
    assert raw.id == "prompts/1" and raw.text == "Once upon a time" and raw.messages == (("user", "Once upon a time"),)
    assert question.id == "q1" and question.text is None and question.messages == (("user", "Why is the sky blue?"),)
    assert turns.id == "9" and turns.messages == (("user", "First turn"),)
    assert load_prompts("prompts", str(data), limit=1, offset=2) == [turns]


def test_prompts_needs_data() -> None:
    with pytest.raises(TaskError, match="task 'prompts' needs a data file; pass --data PATH"):
        load_prompts("prompts")


def test_row_without_known_field_names_line(tmp_path: Path) -> None:
    data = _write(tmp_path / "bad.jsonl", json.dumps({"prompt": "ok"}), json.dumps({"text": "no"}))
    with pytest.raises(TaskError, match=r"bad.jsonl:2: row has none of 'prompt', 'question', 'turns'"):
        load_prompts("prompts", data)


def test_bad_field_values(tmp_path: Path) -> None:
    with pytest.raises(TaskError, match=r"a.jsonl:1: field 'prompt' is missing or not a non-empty string"):
        load_prompts("prompts", _write(tmp_path / "a.jsonl", json.dumps({"prompt": 3})))
    with pytest.raises(TaskError, match=r"b.jsonl:1: 'turns' must be a list"):
        load_prompts("prompts", _write(tmp_path / "b.jsonl", json.dumps({"turns": []})))


def test_malformed_json_names_file_and_line(tmp_path: Path) -> None:
    data = _write(tmp_path / "broken.jsonl", json.dumps({"prompt": "a"}), "{not json", json.dumps({"prompt": "c"}))
    with pytest.raises(TaskError, match=r"broken.jsonl:2: malformed JSON") as info:
        load_prompts("prompts", data)
    assert "\n" not in str(info.value)
    with pytest.raises(TaskError, match=r"list.jsonl:1: expected a JSON object"):
        load_prompts("prompts", _write(tmp_path / "list.jsonl", "[1, 2]"))


def test_missing_file_and_folder(tmp_path: Path) -> None:
    with pytest.raises(TaskError, match="data file not found: .*nope.jsonl"):
        load_prompts("prompts", tmp_path / "nope.jsonl")
    with pytest.raises(TaskError, match="is a folder; pass a .jsonl file"):
        load_prompts("prompts", tmp_path)


def test_empty_file(tmp_path: Path) -> None:
    with pytest.raises(TaskError, match="task 'prompts' has no prompts"):
        load_prompts("prompts", _write(tmp_path / "empty.jsonl", ""))


def test_gzipped_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        handle.write(json.dumps({"question": "zipped?"}) + "\n")
    (prompt,) = load_prompts("prompts", path)
    assert prompt.messages == (("user", "zipped?"),)
