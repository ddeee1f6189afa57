"""The ``prompts`` task: any JSONL file of prompts given with ``--data``."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from studies.errors import TaskError
from studies.jsonl import Row, read_jsonl, text_field
from studies.mt_bench import first_turn
from studies.prompt import Prompt

ID_FIELDS = ("id", "question_id", "task_id")


def _from_prompt(path: Path, lineno: int, row: Row, pid: str) -> Prompt:
    text = text_field(path, lineno, row, "prompt")
    return Prompt(id=pid, messages=(("user", text),), text=text)


def _from_question(path: Path, lineno: int, row: Row, pid: str) -> Prompt:
    return Prompt(id=pid, messages=(("user", text_field(path, lineno, row, "question")),))


def _from_turns(path: Path, lineno: int, row: Row, pid: str) -> Prompt:
    return Prompt(id=pid, messages=(("user", first_turn(path, lineno, row)),))


ROW_SHAPES: dict[str, Callable[[Path, int, Row, str], Prompt]] = {
    "prompt": _from_prompt,  # raw text: completed as is without a chat template
    "question": _from_question,  # a question: asked as a user turn
    "turns": _from_turns,  # MT-Bench style: the first turn asked as a user turn
}
"""Row key -> builder; the first key present in a row decides its shape."""


def _row_id(row: Row, lineno: int) -> str:
    for key in ID_FIELDS:
        value = row.get(key)
        if isinstance(value, (str, int)) and not isinstance(value, bool):
            return str(value)
    return f"prompts/{lineno}"


def row_prompt(path: Path, lineno: int, row: Row) -> Prompt:
    """The Prompt for one row, by the first of ``ROW_SHAPES``' keys it has."""
    for key, build in ROW_SHAPES.items():
        if key in row:
            return build(path, lineno, row, _row_id(row, lineno))
    keys = ", ".join(repr(k) for k in ROW_SHAPES)
    raise TaskError(f"{path}:{lineno}: row has none of {keys}; give each line one of them")


@dataclass(frozen=True)
class JsonlPromptsTask:
    """Rows with ``prompt`` (raw text), ``question`` or MT-Bench ``turns`` (first turn used)."""

    name: str = "prompts"
    summary: str = "your own prompts: a JSONL file given with --data (rows with 'prompt', 'question' or 'turns')"

    def prompts(self, data: Path | None) -> Iterator[Prompt]:
        if data is None:
            raise TaskError(
                "task 'prompts' needs a data file; pass --data PATH to a JSONL file with 'prompt', 'question' or 'turns' in each row"
            )
        for lineno, row in read_jsonl(data):
            yield row_prompt(data, lineno, row)
