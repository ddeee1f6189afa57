"""The `multi-turn` stream: MT-Bench second turns after a cached first-turn answer (a scripted
answerer here; the real one, greedy plain decoding, in tests/autotune/test_first_turns.py)."""
from __future__ import annotations

import collections
import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from studies import STREAMS, AnswerKey, Prompt, TaskError, load_stream, multi_turn_stream, two_turn_questions
from studies.multi_turn import DEFAULT_QUESTIONS, cache_path, spread_questions

KEY = AnswerKey(model="tiny", precision="float32", max_tokens=8)


@dataclass
class Scripted:
    """An answerer that answers from the question's text and counts what it was asked."""

    key: AnswerKey = KEY
    asked: list[str] = field(default_factory=list)

    def answer(self, prompt: Prompt) -> str:
        assert prompt.messages is not None and len(prompt.messages) == 1 and prompt.messages[0][0] == "user"
        self.asked.append(prompt.id)
        return f"answer {len(prompt.messages[0][1])} ({self.key.model})"


def _stream(tmp_path: Path, answerer: Scripted, questions: int = DEFAULT_QUESTIONS, log: list[str] | None = None):
    lines = log if log is not None else []
    return multi_turn_stream(answerer, tmp_path, questions=questions, log=lines.append, first_turns=False)


def test_each_conversation_sends_its_first_turn_then_its_second(tmp_path: Path) -> None:
    stream = multi_turn_stream(Scripted(), tmp_path, questions=3, log=lambda line: None)
    assert [r.prompt.id.rsplit("/", 1)[1] for r in stream] == ["turn-1", "turn-2"] * 3
    for opening, follow in zip(stream[::2], stream[1::2]):
        assert opening.prompt.messages == follow.prompt.messages[:1] and opening.category == follow.category
        assert opening.conversation == follow.conversation  # one client sends both, the second after the first
    assert len({r.conversation for r in stream}) == 3 and None not in {r.conversation for r in stream}
    assert [r.index for r in stream] == list(range(6))


def test_shape_three_messages_the_answer_and_categories(tmp_path: Path) -> None:
    answerer = Scripted()
    stream = _stream(tmp_path, answerer)
    by_id = {q.qid: q for q in two_turn_questions()}
    assert [r.index for r in stream] == list(range(DEFAULT_QUESTIONS))
    for request in stream:
        (r1, turn1), (r2, answer), (r3, turn2) = request.prompt.messages
        question = by_id[request.prompt.id.split("/")[1]]
        assert (r1, r2, r3) == ("user", "assistant", "user")
        assert (turn1, turn2) == question.turns and request.category == question.category
        assert answer == f"answer {len(turn1)} (tiny)"
    counts = collections.Counter(r.category for r in stream)
    assert len(counts) == 8 and set(counts.values()) == {2}  # two of each of MT-Bench's eight categories
    assert len({r.category for r in stream[:8]}) == 8  # any first eight: every category once
    assert len(answerer.asked) == DEFAULT_QUESTIONS


def test_registered_by_name_and_limit_kept(tmp_path: Path) -> None:
    assert "multi-turn" in STREAMS
    stream = load_stream("multi-turn", answerer=Scripted(), cache_dir=tmp_path, questions=3, log=lambda line: None)
    assert [r.category for r in stream] == ["writing", "writing", "roleplay", "roleplay", "reasoning", "reasoning"]


def test_second_call_reads_the_cache(tmp_path: Path) -> None:
    first, log = Scripted(), []
    stream = _stream(tmp_path, first, 4, log)
    path = cache_path(tmp_path, KEY)
    assert path.exists() and str(path).startswith(str(tmp_path / "streams"))
    assert any("answering 4 MT-Bench first turns" in line and str(path) in line for line in log)
    again, log2 = Scripted(), []
    assert _stream(tmp_path, again, 4, log2) == stream
    assert again.asked == [] and log2 == []


def test_more_questions_answer_only_the_missing_ones(tmp_path: Path) -> None:
    _stream(tmp_path, Scripted(), 4)
    more = Scripted()
    stream = _stream(tmp_path, more, 6)
    assert len(stream) == 6 and more.asked == [r.prompt.id.removesuffix("/turn-2") for r in stream[4:]]


def test_another_model_key_regenerates(tmp_path: Path) -> None:
    _stream(tmp_path, Scripted(), 2)
    other = Scripted(key=AnswerKey(model="other", precision="float32", max_tokens=8))
    stream = _stream(tmp_path, other, 2)
    assert len(other.asked) == 2 and stream[0].prompt.messages[1][1].endswith("(other)")
    longer = Scripted(key=AnswerKey(model="tiny", precision="float32", max_tokens=9))
    _stream(tmp_path, longer, 2)
    assert len(longer.asked) == 2  # the answer length is part of the key too
    assert len(list((tmp_path / "streams").glob("*.json"))) == 3


@pytest.mark.parametrize("content", ["{not json", '{"format": 1, "key": {}, "answers": {}}', '[1, 2]',
                                     '{"format": 1, "key": KEY, "answers": {"81": "just text"}}'])
def test_a_corrupt_or_mismatched_cache_file_is_regenerated(tmp_path: Path, content: str) -> None:
    path = cache_path(tmp_path, KEY)
    path.parent.mkdir(parents=True)
    path.write_text(content.replace("KEY", json.dumps(KEY.__dict__)))
    answerer, log = Scripted(), []
    stream = _stream(tmp_path, answerer, 2, log)
    assert len(answerer.asked) == 2 and len(stream) == 2
    assert any(str(path) in line and "regenerating" in line for line in log), log
    data = json.loads(path.read_text())
    assert data["key"] == KEY.__dict__ and len(data["answers"]) == 2
    assert not list(path.parent.glob("*.tmp"))  # written whole: no temporary file left


def test_a_changed_first_turn_is_answered_again(tmp_path: Path) -> None:
    _stream(tmp_path, Scripted(), 2)
    path = cache_path(tmp_path, KEY)
    data = json.loads(path.read_text())
    first_id = next(iter(data["answers"]))
    data["answers"][first_id]["question"] = "another question"
    path.write_text(json.dumps(data))
    again = Scripted()
    _stream(tmp_path, again, 2)
    assert again.asked == [f"mt-bench/{first_id}"]


def test_same_answers_twice(tmp_path: Path) -> None:
    assert _stream(tmp_path / "a", Scripted(), 3) == _stream(tmp_path / "b", Scripted(), 3)


def test_spread_takes_each_category_in_turn() -> None:
    questions = two_turn_questions()
    assert len(questions) == 80 and all(len(q.turns) == 2 for q in questions)
    spread = spread_questions(questions, 10)
    assert [q.category for q in spread[8:]] == ["writing", "roleplay"]
    assert [q.qid for q in spread[:2]] == ["81", "91"] and spread[8].qid == "82"
    assert spread_questions(questions, 80) and len({q.qid for q in spread_questions(questions, 80)}) == 80


@pytest.mark.parametrize("count,needle", [(0, "at least 1 question"), (81, "MT-Bench has 80")])
def test_bad_question_counts(tmp_path: Path, count: int, needle: str) -> None:
    with pytest.raises(TaskError, match=needle):
        _stream(tmp_path, Scripted(), count)


def test_a_question_file_without_second_turns_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "question.jsonl"
    data.write_text(json.dumps({"question_id": 1, "category": "writing", "turns": ["only one"]}) + "\n")
    with pytest.raises(TaskError, match=r"question.jsonl:1: 'turns' must hold two"):
        multi_turn_stream(Scripted(), tmp_path, questions=1, data=data)


@pytest.mark.parametrize("bad", [{"max_tokens": 0}, {"model": " "}, {"precision": ""}])
def test_answer_key_validated(bad: dict) -> None:
    with pytest.raises(TaskError):
        AnswerKey(**{"model": "m", "precision": "float32", "max_tokens": 8, **bad})


def test_an_interrupted_generation_resumes_where_it_stopped(tmp_path: Path) -> None:
    class Interrupted(Scripted):
        def answer(self, prompt: Prompt) -> str:
            if len(self.asked) == 2:
                raise KeyboardInterrupt
            return super().answer(prompt)

    with pytest.raises(KeyboardInterrupt):
        _stream(tmp_path, Interrupted(), 4)
    rest = Scripted()
    stream = _stream(tmp_path, rest, 4)
    assert rest.asked == [r.prompt.id.removesuffix("/turn-2") for r in stream[2:]]
    assert not list((tmp_path / "streams").glob("*.tmp"))
