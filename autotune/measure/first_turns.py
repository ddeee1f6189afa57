"""First-turn answers for the ``multi-turn`` stream (``studies.multi_turn``): greedy plain decoding.

A first turn is encoded as ``autotune serve`` encodes a chat request (``studies.encode_prompt``: the
model's chat template with a generation prompt), decoded greedily with our plain decoder at the given
precision until EOS or ``max_tokens``, and its tokens turned into text as the server returns them
(``skip_special_tokens``): each answer is what the server would answer that turn at that precision
(speculation is lossless, so in any mode). The model loads on the first answer only: a stream whose
answers are cached never loads it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autotune.errors import SettingError
from runtime.precision import AUTO
from studies.multi_turn import DEFAULT_ANSWER_TOKENS, AnswerKey
from studies.prompt import Prompt

DEFAULT_ANSWER_MODEL = "qwen2.5-coder-1.5b"
"""The target the docs serve (``autotune serve --model qwen2.5-coder-1.5b``)."""


@dataclass(frozen=True)
class AnswerSettings:
    """Which model answers the first turns, at which precision and device, and how long at most."""

    model: str = DEFAULT_ANSWER_MODEL
    precision: str = AUTO
    device: str = "cpu"
    max_tokens: int = DEFAULT_ANSWER_TOKENS

    def __post_init__(self) -> None:
        if not self.model.strip():
            raise SettingError("the answer model is empty; name a model alias, folder or hub id")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise SettingError(f"first-turn answers need at least 1 token, got {self.max_tokens!r}")

    def key(self) -> AnswerKey:
        """The cache key, ``auto`` resolved to the precision it means on this machine (no model loads)."""
        from runtime.loading import as_precision
        from runtime.models import resolve_model

        resolve_model(self.model)  # an unknown model fails here, before any answer is asked for
        return AnswerKey(self.model, as_precision(self.precision, self.device).name, self.max_tokens, self.device)


@dataclass
class PlainAnswerer:
    """An :class:`studies.multi_turn.Answerer` decoding greedily with our plain decoder. ``pool``: a
    model pool to load from (tests share one); by default a fresh one on ``settings.device``."""

    settings: AnswerSettings = field(default_factory=AnswerSettings)
    pool: Any = None
    _loaded: tuple[Any, Any, Any] | None = field(default=None, init=False, repr=False)  # target, decoder, config

    @property
    def key(self) -> AnswerKey:
        return self.settings.key()

    def _decoder(self) -> tuple[Any, Any, Any]:
        if self._loaded is None:
            from runtime.decoding import GenerationConfig
            from runtime.pipeline import ModelPool, build_decoder, eos_ids
            from search_spaces.strategy import PLAIN

            s = self.settings
            pool = self.pool if self.pool is not None else ModelPool(device=s.device)
            target = pool.get(s.model, s.precision)
            if target.tokenizer is None:
                raise SettingError(f"model {s.model!r} has no tokenizer; first-turn answers need text")
            config = GenerationConfig(max_new_tokens=s.max_tokens, eos_token_ids=eos_ids(target))  # greedy
            self._loaded = (target, build_decoder(pool, target, PLAIN), config)
        return self._loaded

    def answer(self, prompt: Prompt) -> str:
        from studies.encode import encode_prompt

        target, decoder, config = self._decoder()
        ids = encode_prompt(prompt, target.tokenizer)
        decoder.check_fits(len(ids), config)
        result = decoder.generate(ids, config)
        return target.tokenizer.decode(result.tokens, skip_special_tokens=True)
