"""The ``multi-turn`` stream: MT-Bench's second turns, each sent after its first turn and an answer to
it ([user, assistant, user]): a conversation's second request repeats the first one's prompt and
answer, the traffic where a server's prefix cache matters most.

The first-turn answers are generated once by an :class:`Answerer` (greedy plain decoding on a model:
``autotune.measure.first_turns``; tests pass a fake one or a small model) and cached as JSON in the
folder the caller names, one file per :class:`AnswerKey` (model, precision, answer tokens, device):
a different model writes (and answers) a file of its own, and every server a stream is replayed
against is sent the same conversations. A cache file that is corrupt or made for another key is
regenerated, with a line saying so; questions it lacks (more ``questions``, another ``data`` file,
a changed first turn) are answered and added.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from studies.errors import TaskError
from studies.mt_bench import MtBenchQuestion, two_turn_questions
from studies.prompt import Prompt
from studies.stream_request import StreamRequest

DEFAULT_QUESTIONS = 16
"""Questions in the stream: two of each of MT-Bench's eight categories (16 answers stay cheap)."""
DEFAULT_ANSWER_TOKENS = 96
"""A first-turn answer's length at most, in tokens (as long as a replayed completion by default)."""
CACHE_FOLDER = "streams"
CACHE_FORMAT = 1
LOG_PREFIX = "multi-turn stream"


@dataclass(frozen=True)
class AnswerKey:
    """What first-turn answers depend on, and so what their cache file is keyed by: the model, its
    precision as resolved (``auto`` -> what it means on this machine), the answer tokens and the device."""

    model: str
    precision: str
    max_tokens: int
    device: str = "cpu"

    def __post_init__(self) -> None:
        for name in ("model", "precision", "device"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name).strip():
                raise TaskError(f"answer key {name} must be a non-empty string, got {getattr(self, name)!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise TaskError(f"first-turn answers need at least 1 token, got {self.max_tokens!r}")

    def describe(self) -> str:
        return f"{self.model} at {self.precision} on {self.device}, greedy, at most {self.max_tokens} tokens"

    def file_name(self) -> str:
        """``multi-turn-<model>-<precision>-<tokens>-<hash>.json`` (the hash tells apart keys whose
        readable parts look alike, e.g. two local model folders of one name)."""
        digest = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:10]
        model = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(self.model).name or self.model)
        return f"multi-turn-{model}-{self.precision}-{self.max_tokens}-{digest}.json"


class Answerer(Protocol):
    """Answers a first turn the way the servers replayed against would (greedy, deterministic)."""

    @property
    def key(self) -> AnswerKey: ...

    def answer(self, prompt: Prompt) -> str: ...


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def spread_questions(questions: Sequence[MtBenchQuestion], count: int) -> list[MtBenchQuestion]:
    """``count`` questions taken from each category in turn (categories in file order, each one's
    questions in file order), so any first ``k`` of them spread over the categories."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise TaskError(f"the multi-turn stream needs at least 1 question, got {count!r}")
    if count > len(questions):
        raise TaskError(f"the multi-turn stream asks for {count} questions, MT-Bench has {len(questions)}; "
                        "ask for fewer")
    by_category: dict[str, list[MtBenchQuestion]] = {}
    for question in questions:
        by_category.setdefault(question.category, []).append(question)
    spread: list[MtBenchQuestion] = []
    depth = 0
    while len(spread) < count:
        spread += [group[depth] for group in by_category.values() if depth < len(group)][: count - len(spread)]
        depth += 1
    return spread


# ---------------------------------------------------------------------- the cache file
def cache_path(cache_dir: Path | str, key: AnswerKey) -> Path:
    return Path(cache_dir).expanduser() / CACHE_FOLDER / key.file_name()


def _entries(value: Any) -> dict[str, dict[str, str]]:
    ok = isinstance(value, dict) and all(
        isinstance(entry, dict) and set(entry) == {"question", "answer"}
        and all(isinstance(v, str) for v in entry.values())
        for entry in value.values()
    )
    if not ok:
        raise ValueError("'answers' is not a map of question id to {question, answer} strings")
    return value


def read_answers(path: Path, key: AnswerKey) -> tuple[dict[str, dict[str, str]], str | None]:
    """The cached answers by question id, and why the file cannot be used (None: it can; a missing
    file is no answers, not a problem)."""
    if not path.exists():
        return {}, None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT:
            raise ValueError(f"not a format-{CACHE_FORMAT} answers file")
        if data.get("key") != asdict(key):
            return {}, f"it was made for {data.get('key')!r}, not {asdict(key)!r}"
        return _entries(data.get("answers")), None
    except (OSError, UnicodeDecodeError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
        return {}, f"it is corrupt ({exc})"


def write_answers(path: Path, key: AnswerKey, entries: dict[str, dict[str, str]]) -> None:
    """Write the cache file whole or not at all (a temporary file renamed over it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"format": CACHE_FORMAT, "key": asdict(key), "answers": entries}, indent=1, ensure_ascii=False)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")
        os.chmod(tmp, 0o644)  # as an ordinary file (mkstemp makes it private)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def first_turn_answers(questions: Sequence[MtBenchQuestion], answerer: Answerer, cache_dir: Path | str,
                       log: Callable[[str], None] = _stderr) -> dict[str, str]:
    """Each question's first-turn answer by question id: read from the cache, the missing ones
    generated (with a line per answer on ``log``) and added to it one by one."""
    key = answerer.key
    path = cache_path(cache_dir, key)
    entries, problem = read_answers(path, key)
    if problem is not None:
        log(f"{LOG_PREFIX}: {path}: {problem}; regenerating it")
    todo = [q for q in questions if entries.get(q.qid, {}).get("question") != q.turns[0]]
    if todo:
        log(f"{LOG_PREFIX}: answering {len(todo)} MT-Bench first turns with {key.describe()} "
            f"(once; cached in {path})")
        for i, question in enumerate(todo, start=1):
            started = time.perf_counter()
            answer = answerer.answer(Prompt(id=f"mt-bench/{question.qid}", messages=(("user", question.turns[0]),)))
            if not isinstance(answer, str):
                raise TypeError(f"the answerer answered question {question.qid} with a {type(answer).__name__}, "
                                "not a str")
            entries[question.qid] = {"question": question.turns[0], "answer": answer}
            write_answers(path, key, entries)  # after each answer: an interrupted run resumes where it stopped
            log(f"{LOG_PREFIX}: answer {i}/{len(todo)} ({question.category}, question {question.qid}): "
                f"{time.perf_counter() - started:.1f} s")
    return {q.qid: entries[q.qid]["answer"] for q in questions}


def multi_turn_stream(answerer: Answerer, cache_dir: Path | str, questions: int = DEFAULT_QUESTIONS,
                      data: Path | str | None = None, log: Callable[[str], None] = _stderr,
                      first_turns: bool = True) -> list[StreamRequest]:
    """``questions`` MT-Bench conversations spread over the categories (see :func:`spread_questions`),
    under their MT-Bench category: each first turn ([user turn 1]), then its second turn as [user turn
    1, assistant answer 1, user turn 2] (``first_turns=False``: the second turns alone). A server that
    answered the first turn greedily as the answerer did has that whole history cached by the
    second. ``answerer`` writes the first-turn answers the first time (cached in ``cache_dir``);
    ``data``: another MT-Bench question file."""
    chosen = spread_questions(two_turn_questions(Path(data) if data is not None else None), questions)
    answers = first_turn_answers(chosen, answerer, cache_dir, log)
    requests: list[StreamRequest] = []
    for question in chosen:
        first, second = question.turns
        if first_turns:
            opening = Prompt(id=f"mt-bench/{question.qid}/turn-1", messages=(("user", first),))
            requests.append(StreamRequest(len(requests), question.category, opening, f"mt-bench/{question.qid}"))
        messages = (("user", first), ("assistant", answers[question.qid]), ("user", second))
        prompt = Prompt(id=f"mt-bench/{question.qid}/turn-2", messages=messages)
        requests.append(StreamRequest(len(requests), question.category, prompt, f"mt-bench/{question.qid}"))
    return requests
