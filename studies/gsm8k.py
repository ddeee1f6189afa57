"""GSM8K (Cobbe et al., 2021): grade-school math, prompted 5-shot as in SWIFT."""
from __future__ import annotations

import importlib.util
import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from studies.errors import TaskError
from studies.fewshot import question_answer_shots
from studies.jsonl import find_data_file, read_jsonl, text_field
from studies.prompt import Prompt

DATA_DIR_ENV = "AUTOTUNE_DATA_DIR"
"""Environment variable naming a folder that holds ``gsm8k/test.jsonl`` (and ``train.jsonl`` beside it)."""
HUB_DATASET = ("openai/gsm8k", "main")
CANDIDATES = ("gsm8k/test.jsonl", "test.jsonl")
HOW_TO = f"pass --data PATH or set {DATA_DIR_ENV} to the folder holding gsm8k/test.jsonl"

QA = tuple[str, str]  # (question, answer)


def _local_test_file(data: Path | None) -> Path | None:
    """The test.jsonl named by ``data`` or ``$AUTOTUNE_DATA_DIR``; None when neither is set."""
    if data is not None:
        path = find_data_file(data, CANDIDATES)
        if path is None:
            raise TaskError(f"GSM8K data not found at {data}; {HOW_TO}")
        return path
    env = os.environ.get(DATA_DIR_ENV)
    if not env:
        return None
    root = Path(env).expanduser()
    path = find_data_file(root, CANDIDATES) if root.is_dir() else None
    if path is None:
        raise TaskError(f"GSM8K data not found at {root / CANDIDATES[0]} (from ${DATA_DIR_ENV}); {HOW_TO}")
    return path


def _file_rows(path: Path) -> Iterator[QA]:
    for lineno, row in read_jsonl(path):
        yield text_field(path, lineno, row, "question"), text_field(path, lineno, row, "answer")


def _local_source(test_file: Path, shots: int) -> tuple[list[QA], Iterator[QA]]:
    train_file = test_file.parent / "train.jsonl"
    if not train_file.is_file():
        raise TaskError(f"GSM8K few-shot exemplars not found at {train_file}; put GSM8K's train.jsonl beside {test_file.name}")
    exemplars = list(itertools.islice(_file_rows(train_file), shots))
    if len(exemplars) < shots:
        raise TaskError(f"{train_file} has {len(exemplars)} rows, {shots} few-shot exemplars are needed; use the full train.jsonl")
    return exemplars, _file_rows(test_file)


def hub_available() -> bool:
    """Whether the ``datasets`` package (for loading GSM8K from the hub) is installed."""
    return importlib.util.find_spec("datasets") is not None


def _hub_source(shots: int) -> tuple[list[QA], Iterator[QA]]:  # pragma: no cover - needs network
    import datasets  # type: ignore[import-not-found]

    try:
        dataset = datasets.load_dataset(*HUB_DATASET)
    except Exception as exc:  # network, auth, cache: report in one line
        raise TaskError(f"could not load {HUB_DATASET[0]} from the hub ({type(exc).__name__}); {HOW_TO}") from exc
    train = dataset["train"]
    exemplars = [(train[i]["question"], train[i]["answer"]) for i in range(shots)]
    return exemplars, ((row["question"], row["answer"]) for row in dataset["test"])


@dataclass(frozen=True)
class Gsm8kTask:
    """Test questions, each after ``shots`` fixed exemplars (the first rows of train.jsonl)."""

    name: str = "gsm8k"
    summary: str = f"GSM8K: grade-school math, 5-shot (data from --data, ${DATA_DIR_ENV} or the hub)"
    shots: int = 5

    def source(self, data: Path | None) -> tuple[list[QA], Iterator[QA]]:
        """(exemplars, test rows) from a local file, else from the hub when ``datasets`` is installed."""
        test_file = _local_test_file(data)
        if test_file is not None:
            return _local_source(test_file, self.shots)
        if not hub_available():
            raise TaskError(f"GSM8K data not found: no --data and {DATA_DIR_ENV} is not set; {HOW_TO}")
        return _hub_source(self.shots)

    def prompts(self, data: Path | None) -> Iterator[Prompt]:
        exemplars, rows = self.source(data)
        for index, (question, answer) in enumerate(rows):
            text = question_answer_shots(exemplars, question)
            yield Prompt(id=f"{self.name}/{index}", messages=(("user", text),), text=text, reference=answer)
