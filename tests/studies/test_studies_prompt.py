"""Prompt values, render_prompt with and without a chat template, and routing_text."""
from __future__ import annotations

from typing import Any

import pytest

from studies import Prompt, TaskError, render_prompt, routing_text


class TemplateTokenizer:
    """A tiny stand-in for a chat tokenizer: records calls, renders <|role|>content<|end|>."""

    chat_template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def apply_chat_template(
        self, conversation: list[dict[str, str]], tokenize: bool = True, add_generation_prompt: bool = False
    ) -> Any:
        self.calls.append({"conversation": conversation, "tokenize": tokenize, "add_generation_prompt": add_generation_prompt})
        text = "".join(f"<|{m['role']}|>{m['content']}<|end|>" for m in conversation)
        text += "<|assistant|>" if add_generation_prompt else ""
        return [ord(c) for c in text] if tokenize else text


class PlainTokenizer:
    """A base-model tokenizer: no chat template."""

    chat_template = None


CHAT_AND_TEXT = Prompt(id="p", messages=(("system", "Be brief."), ("user", "Hi")), text="Hi there")


def test_template_used_for_messages() -> None:
    tok = TemplateTokenizer()
    assert render_prompt(CHAT_AND_TEXT, tok) == "<|system|>Be brief.<|end|><|user|>Hi<|end|><|assistant|>"
    (call,) = tok.calls
    assert call["tokenize"] is False and call["add_generation_prompt"] is True
    assert call["conversation"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_no_template_uses_text() -> None:
    assert render_prompt(CHAT_AND_TEXT, PlainTokenizer()) == "Hi there"
    assert render_prompt(CHAT_AND_TEXT, object()) == "Hi there"  # no chat_template attribute at all


def test_text_only_prompt_ignores_template() -> None:
    tok = TemplateTokenizer()
    assert render_prompt(Prompt(id="t", text="def f():"), tok) == "def f():"
    assert tok.calls == []


def test_messages_without_template_join_as_turns() -> None:
    prompt = Prompt(id="m", messages=(("system", "Be brief."), ("user", "What is 2+2?")))
    rendered = render_prompt(prompt, PlainTokenizer())
    assert rendered == "System: Be brief.\n\nUser: What is 2+2?\n\nAssistant:"


def test_prompt_needs_a_form() -> None:
    with pytest.raises(TaskError, match="neither messages nor text"):
        Prompt(id="x")
    with pytest.raises(TaskError, match="empty message list"):
        Prompt(id="x", messages=())
    with pytest.raises(TaskError, match="malformed turn"):
        Prompt(id="x", messages=(("user",),))  # type: ignore[arg-type]


def test_prompt_is_frozen_and_hashable() -> None:
    with pytest.raises(AttributeError):
        CHAT_AND_TEXT.text = "changed"  # type: ignore[misc]
    assert len({CHAT_AND_TEXT, Prompt(id="p", messages=(("system", "Be brief."), ("user", "Hi")), text="Hi there")}) == 1


def test_routing_text_is_the_last_user_turn_else_the_text() -> None:
    chat = Prompt(id="c", messages=(
        ("system", "You are a helpful assistant."), ("user", "Q: 2+2?"), ("assistant", "4"), ("user", "Q: 3+5?"),
    ), text="plain form")
    assert routing_text(chat) == "Q: 3+5?"
    assert routing_text(Prompt(id="t", text="def f():")) == "def f():"
    assert routing_text(Prompt(id="s", messages=(("system", "be brief"),), text="hello")) == "hello"
    assert routing_text(Prompt(id="a", messages=(("system", "be brief"), ("assistant", "hi")))) == "hi"
