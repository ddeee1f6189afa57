"""Request streams for replaying against a server: the ``mixed`` shifting workload, the
``multi-turn`` conversations (``studies.multi_turn``) and JSONL files.

``mixed_stream`` runs in blocks of ``block`` consecutive requests of one task; each round of blocks
visits every task once in a seeded order that differs from the round before (and, with three tasks
or more, does not start with the task the last round ended on, so every block boundary is a shift).
Each task's prompts are taken in order from ``offset`` on, never twice: start past the prompts a
study tuned on to replay traffic it has not seen.

A stream file is JSONL, one request a line: ``{"category": ..., "messages": [[role, content], ...]}``
or ``{"category": ..., "prompt": text}`` (asked as one user turn), with an optional ``id`` and an
optional ``conversation`` (lines of one conversation are sent in file order, each after the last
one's answer).
"""
from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from studies.errors import TaskError
from studies.jsonl import Row, read_jsonl, text_field
from studies.multi_turn import multi_turn_stream
from studies.prompt import Message, Prompt
from studies.stream_request import StreamRequest
from studies.tasks import get_task, load_prompts

DEFAULT_MIXED_TASKS: tuple[str, ...] = ("humaneval", "gsm8k", "mt-bench", "xsum", "nq-open", "asdiv", "translation")
DEFAULT_BLOCK = 4
"""Requests in a row of one task."""
DEFAULT_BLOCKS_PER_TASK = 3
"""Blocks of each task in the stream (= rounds: each round holds one block of every task)."""
DEFAULT_OFFSET = 20
"""The first prompt of each task used: past `autotune study`'s default ten tuning prompts, with room."""
DEFAULT_SEED = 0
ORDER_TRIES = 64  # seeded shuffles tried for a round before falling back to rotating the last order


def _acceptable(order: tuple[str, ...], last: tuple[str, ...] | None) -> bool:
    if last is None or len(order) < 2:
        return True
    boundary_ok = len(order) < 3 or order[0] != last[-1]
    return order != last and boundary_ok


def round_orders(tasks: Sequence[str], rounds: int, seed: int) -> list[tuple[str, ...]]:
    """``rounds`` seeded orders of ``tasks``; each differs from the one before it (two tasks or more),
    and with three or more starts with a task other than the one the previous order ended on."""
    rng = random.Random(seed)
    orders: list[tuple[str, ...]] = []
    for _ in range(rounds):
        last = orders[-1] if orders else None
        order = tuple(rng.sample(list(tasks), len(tasks)))
        tries = 1
        while not _acceptable(order, last) and tries < ORDER_TRIES:
            order, tries = tuple(rng.sample(list(tasks), len(tasks))), tries + 1
        if not _acceptable(order, last):
            assert last is not None
            order = last[1:] + last[:1]  # differs, and starts with last[1] != last[-1] (3+ tasks)
        orders.append(order)
    return orders


def _check_mixed(tasks: Sequence[str], block: int, blocks_per_task: int, offset: int) -> None:
    if not tasks:
        raise TaskError("a mixed stream needs at least one task")
    repeated = sorted({t for t in tasks if list(tasks).count(t) > 1})
    if repeated:
        raise TaskError(f"task {repeated[0]!r} is listed twice in the mixed stream; list each task once")
    for name, value in (("block", block), ("blocks per task", blocks_per_task)):
        if value < 1:
            raise TaskError(f"{name} must be at least 1, got {value}")
    if offset < 0:
        raise TaskError(f"offset must be 0 or more, got {offset}")
    for name in tasks:
        get_task(name)  # an unknown name fails before any data is read


def _task_prompts(name: str, data: Path | str | None, needed: int, offset: int) -> list[Prompt]:
    prompts = load_prompts(name, data, needed, offset)
    if len(prompts) < needed:
        raise TaskError(f"task {name!r} has {len(prompts)} prompts from offset {offset}, the stream needs {needed}; "
                        "lower the offset, the block or the blocks per task")
    return prompts


def mixed_stream(tasks: Sequence[str] = DEFAULT_MIXED_TASKS, block: int = DEFAULT_BLOCK,
                 blocks_per_task: int = DEFAULT_BLOCKS_PER_TASK, offset: int = DEFAULT_OFFSET, seed: int = DEFAULT_SEED,
                 data: Mapping[str, Path | str] | None = None) -> list[StreamRequest]:
    """The shifting workload: ``blocks_per_task`` rounds, each one ``block``-request block of every task
    in that round's order (see :func:`round_orders`). ``data`` maps a task name to its ``--data`` path."""
    _check_mixed(tasks, block, blocks_per_task, offset)
    data = data or {}
    needed = block * blocks_per_task
    pools = {name: iter(_task_prompts(name, data.get(name), needed, offset)) for name in tasks}
    requests: list[StreamRequest] = []
    for order in round_orders(tasks, blocks_per_task, seed):
        for name in order:
            for prompt in itertools.islice(pools[name], block):
                requests.append(StreamRequest(len(requests), name, prompt))
    return requests


# ---------------------------------------------------------------------- stream files
def _messages(path: Path, lineno: int, value: Any) -> tuple[Message, ...]:
    ok = isinstance(value, list) and value and all(
        isinstance(turn, (list, tuple)) and len(turn) == 2 and all(isinstance(part, str) for part in turn)
        for turn in value
    )
    if not ok:
        raise TaskError(f"{path}:{lineno}: 'messages' must be a non-empty list of [role, content] string pairs; "
                        "fix that line")
    return tuple((role, content) for role, content in value)


def stream_row(path: Path, lineno: int, row: Row, index: int) -> StreamRequest:
    """The request one line of a stream file describes, or a TaskError naming the line."""
    category = text_field(path, lineno, row, "category")
    rid = row.get("id")
    pid = str(rid) if isinstance(rid, (str, int)) and not isinstance(rid, bool) else f"{category}/{lineno}"
    if "messages" in row:
        prompt = Prompt(id=pid, messages=_messages(path, lineno, row["messages"]))
    elif "prompt" in row:
        text = text_field(path, lineno, row, "prompt")
        prompt = Prompt(id=pid, messages=(("user", text),), text=text)
    else:
        raise TaskError(f"{path}:{lineno}: row has neither 'messages' nor 'prompt'; give each line one of them")
    conversation = text_field(path, lineno, row, "conversation") if "conversation" in row else None
    return StreamRequest(index, category, prompt, conversation)


def read_stream(path: Path | str) -> list[StreamRequest]:
    """The requests of a stream file, in file order (indexes 0, 1, ...); an empty file is an error."""
    path = Path(path).expanduser()
    requests = [stream_row(path, lineno, row, index) for index, (lineno, row) in enumerate(read_jsonl(path))]
    if not requests:
        raise TaskError(f"{path} holds no requests; write one JSON object a line")
    return requests


def stream_line(request: StreamRequest) -> str:
    """One request as a stream-file line (its chat form; ``id`` is the prompt's id)."""
    assert request.prompt.messages is not None  # guaranteed by StreamRequest.__post_init__
    row = {"id": request.prompt.id, "category": request.category,
           "messages": [list(turn) for turn in request.prompt.messages]}
    if request.conversation is not None:
        row["conversation"] = request.conversation
    return json.dumps(row, ensure_ascii=False)


def write_stream(requests: Sequence[StreamRequest], path: Path | str) -> Path:
    """Write ``requests`` as a stream file (JSONL) that :func:`read_stream` reads back."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(stream_line(r) + "\n" for r in requests), encoding="utf-8")
    return path


STREAMS: dict[str, Callable[..., list[StreamRequest]]] = {"mixed": mixed_stream, "multi-turn": multi_turn_stream}
"""Named streams (keyword arguments as their functions take them); anything else is a file path."""


def load_stream(spec: str, **options: Any) -> list[StreamRequest]:
    """The stream ``spec`` names: a registered stream (built with ``options``) or a stream file."""
    if spec in STREAMS:
        return STREAMS[spec](**options)
    if not Path(spec).expanduser().exists():
        raise TaskError(f"unknown stream {spec!r}: not one of {', '.join(sorted(STREAMS))} and no such file; "
                        "pass a stream name or a .jsonl file")
    if options:
        raise TaskError(f"{', '.join(sorted(options))} only apply to a named stream, not to the file {spec}")
    return read_stream(spec)
