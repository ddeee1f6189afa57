"""The Prompt value and how it becomes model input text."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from studies.errors import TaskError

Message = tuple[str, str]
"""One chat turn: (role, content), role as in chat templates ("system", "user", "assistant")."""


class ChatTokenizer(Protocol):
    """The part of a Hugging Face tokenizer that :func:`render_prompt` uses."""

    chat_template: str | None

    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: Any) -> Any: ...


@dataclass(frozen=True)
class Prompt:
    """One prompt of a task, in up to two forms.

    ``messages`` is the chat form (used when the tokenizer has a chat template); ``text`` is the
    plain completion form (used otherwise). At least one is set. A prompt with only ``messages``
    renders without a template as ``"User: ...\\n\\nAssistant:"``. ``reference`` is the task's
    reference answer where it has one (not shown to the model).
    """

    id: str
    messages: tuple[Message, ...] | None = None
    text: str | None = None
    reference: str | None = None

    def __post_init__(self) -> None:
        if self.messages is None and self.text is None:
            raise TaskError(f"prompt {self.id!r} has neither messages nor text; give at least one")
        if self.messages is not None:
            if not self.messages:
                raise TaskError(f"prompt {self.id!r} has an empty message list; give at least one (role, content) turn")
            for turn in self.messages:
                if len(turn) != 2 or not all(isinstance(part, str) for part in turn):
                    raise TaskError(f"prompt {self.id!r} has a malformed turn {turn!r}; each turn is (role, content) strings")


def _plain_chat(messages: tuple[Message, ...]) -> str:
    """Join turns as "Role: content" blocks, ending so the model continues as the assistant."""
    turns = [f"{role.capitalize()}: {content}" for role, content in messages]
    return "\n\n".join(turns) + "\n\nAssistant:"


def routing_text(prompt: Prompt) -> str:
    """The text that says what kind of request ``prompt`` is (what a task router compares).

    With a chat form: the content of the last user turn (system prompts and few-shot turns before it
    would otherwise dominate; exemplars written inside that same turn stay part of it). Otherwise
    the plain text. A chat form with no user turn gives the plain text when there is one, else the
    last turn's content. Studies store this for the prompts they tune on and the server computes
    it for requests, so both sides compare the same kind of text.
    """
    if prompt.messages is not None:
        users = [content for role, content in prompt.messages if role == "user"]
        if users:
            return users[-1]
        if prompt.text is None:
            return prompt.messages[-1][1]
    assert prompt.text is not None  # guaranteed by Prompt.__post_init__
    return prompt.text


def render_prompt(prompt: Prompt, tokenizer: ChatTokenizer | Any) -> str:
    """The text to tokenize for ``prompt``.

    With a chat template on the tokenizer and a chat form on the prompt: the template applied with
    a generation prompt. Otherwise the plain text, or the turns joined as "Role: content" blocks.
    """
    if getattr(tokenizer, "chat_template", None) is not None and prompt.messages is not None:
        conversation = [{"role": role, "content": content} for role, content in prompt.messages]
        rendered = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        if not isinstance(rendered, str):
            raise TypeError(f"apply_chat_template(tokenize=False) returned {type(rendered).__name__}, expected str")
        return rendered
    if prompt.text is not None:
        return prompt.text
    assert prompt.messages is not None  # guaranteed by Prompt.__post_init__
    return _plain_chat(prompt.messages)
