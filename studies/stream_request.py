"""One request of a replayable stream (``studies.stream``, ``studies.multi_turn``)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from studies.errors import TaskError
from studies.prompt import Prompt


@dataclass(frozen=True)
class StreamRequest:
    """One request of a stream: its position, its category (the task it came from) and its prompt.
    Requests of one ``conversation`` (None: a request on its own) are sent in stream order, each after
    the last one's answer, as one user would send them (a second turn after its first)."""

    index: int
    category: str
    prompt: Prompt
    conversation: str | None = None

    def __post_init__(self) -> None:
        if self.index < 0:
            raise TaskError(f"stream request index must be 0 or more, got {self.index}")
        if not self.category.strip():
            raise TaskError(f"stream request {self.index} has an empty category; name the task it comes from")
        if self.prompt.messages is None:
            raise TaskError(f"stream request {self.index} has no chat form; streams are replayed as chat requests")


def conversations(requests: Sequence[StreamRequest]) -> list[list[StreamRequest]]:
    """``requests`` as units one client sends in order: each conversation's requests together (in
    stream order, at its first request's place), every other request alone."""
    units: list[list[StreamRequest]] = []
    by_name: dict[str, list[StreamRequest]] = {}
    for r in requests:
        if r.conversation is None:
            units.append([r])
        elif r.conversation in by_name:
            by_name[r.conversation].append(r)
        else:
            units.append(by_name.setdefault(r.conversation, [r]))
    return units
