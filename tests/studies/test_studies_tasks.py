"""The task registry and the packaged/shared data sets (GSM8K, HumanEval, MT-Bench)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import studies.gsm8k
from studies import DATA_DIR_ENV, TASKS, Task, TaskError, get_task, load_prompts

SHARED_DATA = Path(os.environ.get(DATA_DIR_ENV) or Path(__file__).resolve().parents[3] / "shared" / "data")


@pytest.fixture
def gsm8k_env(monkeypatch: pytest.MonkeyPatch) -> Path:
    assert (SHARED_DATA / "gsm8k" / "test.jsonl").is_file(), f"GSM8K not found under {SHARED_DATA}"
    monkeypatch.setenv(DATA_DIR_ENV, str(SHARED_DATA))
    return SHARED_DATA / "gsm8k"


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(encoding="utf-8") as handle:
        return [json.loads(next(handle)) for _ in range(6)]


def test_registry_names_and_protocol() -> None:
    assert sorted(TASKS) == ["asdiv", "gsm8k", "humaneval", "mt-bench", "nq-open", "prompts", "translation", "xsum"]
    for name, task in TASKS.items():
        assert isinstance(task, Task) and task.name == name and task.summary
        assert get_task(name) is task


def test_unknown_task_lists_known() -> None:
    with pytest.raises(TaskError, match=r"unknown task 'gsm9k'; known tasks: asdiv, gsm8k, humaneval, mt-bench, nq-open, prompts, translation, xsum"):
        get_task("gsm9k")
    with pytest.raises(TaskError, match="unknown task 'GSM8K'"):
        load_prompts("GSM8K")  # exact lookups only


def test_gsm8k_five_shot(gsm8k_env: Path) -> None:
    train, test = _rows(gsm8k_env / "train.jsonl"), _rows(gsm8k_env / "test.jsonl")
    (prompt,) = load_prompts("gsm8k", limit=1)
    text = prompt.text
    assert text is not None and prompt.id == "gsm8k/0" and prompt.reference == test[0]["answer"]
    assert text.count("Question: ") == 6 and text.count("\nAnswer:") == 6
    shots = "".join(f"Question: {r['question']}\nAnswer: {r['answer']}\n\n" for r in train[:5])
    assert text == shots + f"Question: {test[0]['question']}\nAnswer:"
    assert train[5]["question"] not in text
    assert prompt.messages == (("user", text),)


def test_gsm8k_offset(gsm8k_env: Path) -> None:
    first = load_prompts("gsm8k", limit=4)
    later = load_prompts("gsm8k", limit=2, offset=2)
    assert [p.id for p in first] == ["gsm8k/0", "gsm8k/1", "gsm8k/2", "gsm8k/3"]
    assert later == first[2:]
    assert len({p.text for p in first}) == 4


@pytest.mark.parametrize("form", ["file", "folder", "parent"])
def test_gsm8k_data_argument(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, form: str) -> None:
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    folder = tmp_path / "gsm8k"
    folder.mkdir()
    rows = [{"question": f"q{i}", "answer": f"a{i}\n#### {i}"} for i in range(6)]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "test.jsonl").write_text(json.dumps({"question": "What?", "answer": "#### 1"}) + "\n")
    data = {"file": folder / "test.jsonl", "folder": folder, "parent": tmp_path}[form]
    (prompt,) = load_prompts("gsm8k", str(data))
    assert prompt.text is not None and prompt.text.endswith("Question: q4\nAnswer: a4\n#### 4\n\nQuestion: What?\nAnswer:")
    assert "q5" not in prompt.text


def test_gsm8k_missing_data_says_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    with pytest.raises(TaskError, match=f"GSM8K data not found at {tmp_path}; pass --data PATH or set {DATA_DIR_ENV}"):
        load_prompts("gsm8k", tmp_path)
    monkeypatch.setattr(studies.gsm8k, "hub_available", lambda: False)
    with pytest.raises(TaskError, match=f"{DATA_DIR_ENV} is not set"):
        load_prompts("gsm8k")
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    with pytest.raises(TaskError, match=rf"gsm8k/test.jsonl \(from \${DATA_DIR_ENV}\)"):
        load_prompts("gsm8k")


def test_gsm8k_needs_train_beside_test(tmp_path: Path) -> None:
    (tmp_path / "test.jsonl").write_text('{"question": "q", "answer": "a"}\n')
    with pytest.raises(TaskError, match="few-shot exemplars not found at .*train.jsonl"):
        load_prompts("gsm8k", tmp_path)


def test_humaneval_from_package() -> None:
    prompts = load_prompts("humaneval")
    assert len(prompts) == 164 and prompts[0].id == "HumanEval/0"
    first = prompts[0]
    assert first.text is not None and first.text.lstrip().startswith("from typing import List")
    assert "def has_close_elements" in first.text
    assert first.messages == (("user", f"Complete the following Python function:\n```python\n{first.text}```"),)
    assert load_prompts("humaneval", limit=2, offset=3) == prompts[3:5]


def test_humaneval_offset_past_end() -> None:
    with pytest.raises(TaskError, match="has 164 prompts, offset 200 leaves none; use an offset below 164"):
        load_prompts("humaneval", offset=200)


def test_mt_bench_from_package() -> None:
    prompts = load_prompts("mt-bench")
    assert len(prompts) == 80 and prompts[0].id == "mt-bench/81"
    assert prompts[0].text is None and prompts[0].messages is not None
    ((role, content),) = prompts[0].messages
    assert role == "user" and content.startswith("Compose an engaging travel blog post")
    assert "Rewrite your previous response" not in content  # first turn only


def test_data_override_for_packaged_tasks(tmp_path: Path) -> None:
    (tmp_path / "question.jsonl").write_text(json.dumps({"question_id": 7, "turns": ["Hello?", "More?"]}) + "\n")
    (prompt,) = load_prompts("mt-bench", tmp_path)
    assert prompt.id == "mt-bench/7" and prompt.messages == (("user", "Hello?"),)
    he = tmp_path / "he.jsonl"
    he.write_text(json.dumps({"task_id": "X/0", "prompt": "def f():\n"}) + "\n")
    (prompt,) = load_prompts("humaneval", he)
    assert prompt.id == "X/0" and prompt.text == "def f():\n"
    with pytest.raises(TaskError, match="HumanEval data not found at .*; pass --data"):
        load_prompts("humaneval", tmp_path / "nowhere")


@pytest.mark.parametrize("limit", [0, -3])
def test_limit_must_be_positive(limit: int) -> None:
    with pytest.raises(TaskError, match=f"limit must be at least 1, got {limit}"):
        load_prompts("humaneval", limit=limit)


def test_negative_offset() -> None:
    with pytest.raises(TaskError, match="offset must be 0 or more"):
        load_prompts("humaneval", offset=-1)
