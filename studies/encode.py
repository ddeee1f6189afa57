"""Prompt -> token ids, the one way every entry point does it (``generate``, ``bench``, ``study``,
``serve``): the rendered text (chat template when the tokenizer has one and the prompt has turns),
tokenised without adding special tokens a template already wrote."""
from __future__ import annotations

from typing import Any

from studies.prompt import Prompt, render_prompt


def encode_prompt(prompt: Prompt, tokenizer: Any) -> list[int]:
    text = render_prompt(prompt, tokenizer)
    templated = getattr(tokenizer, "chat_template", None) is not None and prompt.messages is not None
    return list(tokenizer(text, add_special_tokens=not templated)["input_ids"])
