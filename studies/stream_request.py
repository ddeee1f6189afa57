"""One request of a replayable stream (``studies.stream``, ``studies.multi_turn``)."""
from __future__ import annotations

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
