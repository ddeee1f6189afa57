"""The Strategy value: how to speculate. Frozen, validated, JSON round-trip with a schema version.

The tuner issue grows this (layer plans, trees, thresholds); fields added later get defaults so
older JSON keeps loading.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

SCHEMA_VERSION = 1

DRAFTER_KINDS = ("none", "draft-model")
DRAFT_PRECISIONS = ("auto", "float32", "bfloat16", "int8")
MAX_DRAFT_LENGTH = 64


class StrategyError(ValueError):
    """A strategy field holds an invalid value; the message names field, value and allowed range."""


@dataclass(frozen=True)
class Strategy:
    """How to decode.

    - ``drafter``: ``none`` (plain decoding) or ``draft-model`` (a smaller model of the family).
    - ``draft_length``: tokens drafted per round (gamma).
    - ``draft_precision``: arithmetic of the draft (``auto`` = int8 on CPU, bfloat16 on GPU). Only
      the target must be exact, so a low-precision draft stays lossless: the target verifies
      every token.
    - ``confidence_threshold``: stop a draft chain early once the draft's top-1 probability
      falls below this (SWIFT's confidence-aware drafting); 0 disables.
    - ``draft_vocab``: restrict the draft's output head to token ids ``[0, draft_vocab)`` (BPE ids
      are roughly frequency-ordered); ``None`` keeps the full head. Lossless either way.
    """

    drafter: str = "draft-model"
    draft_length: int = 10
    draft_precision: str = "auto"
    draft_vocab: int | None = 32768
    confidence_threshold: float = 0.6
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        _check_choice("drafter", self.drafter, DRAFTER_KINDS)
        _check_choice("draft_precision", self.draft_precision, DRAFT_PRECISIONS)
        _check_int("draft_length", self.draft_length, 1, MAX_DRAFT_LENGTH)
        if self.draft_vocab is not None:
            _check_int("draft_vocab", self.draft_vocab, 1, 10**7)
        _check_float("confidence_threshold", self.confidence_threshold, 0.0, 1.0)
        if self.schema_version != SCHEMA_VERSION:
            raise StrategyError(
                f"schema_version={self.schema_version!r} is not supported (this build reads {SCHEMA_VERSION})"
            )

    @property
    def speculates(self) -> bool:
        return self.drafter != "none"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Strategy":
        if not isinstance(data, dict):
            raise StrategyError(f"a strategy must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise StrategyError(f"unknown strategy field(s) {unknown}; known: {sorted(known)}")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> "Strategy":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise StrategyError(f"strategy is not valid JSON: {exc}") from exc
        return cls.from_dict(data)



def _check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise StrategyError(f"{name}={value!r} is not allowed; choose one of {', '.join(allowed)}")


def _check_float(name: str, value: Any, lo: float, hi: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise StrategyError(f"{name}={value!r} is out of range; allowed numbers {lo}..{hi}")


def _check_int(name: str, value: Any, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise StrategyError(f"{name}={value!r} is out of range; allowed integers {lo}..{hi}")


PLAIN = Strategy(drafter="none")  # plain decoding: a point of every search space
