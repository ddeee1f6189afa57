"""Generated tokens -> text deltas for streaming, with OpenAI ``stop`` strings.

The whole text is decoded again after each round (``skip_special_tokens``, exactly what
``autotune generate`` prints) and only what is certain is released: not a trailing partial UTF-8
character (U+FFFD), and not a tail that could still become a stop string. A stop string ends the
text before it (OpenAI semantics) and stops decoding.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TextStream:
    tokenizer: Any
    stops: list[str] = field(default_factory=list)
    sent: int = 0  # characters released so far
    text: str = ""  # the current text (cut at a stop string once one is seen)
    stopped: bool = False

    def push(self, tokens: list[int]) -> str:
        """The new tokens so far -> the text to release now (may be empty)."""
        if self.stopped:
            return ""
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = text[:cut], True
            return self._release(len(self.text))
        self.text = text
        safe = len(text)
        while safe > self.sent and text[safe - 1] == "\ufffd":  # an incomplete multi-byte character
            safe -= 1
        hold = max((len(s) - 1 for s in self.stops), default=0)
        for k in range(min(hold, safe - self.sent), 0, -1):  # a tail that may start a stop string
            tail = text[safe - k : safe]
            if any(s.startswith(tail) for s in self.stops):
                safe -= k
                break
        return self._release(safe)

    def finish(self) -> str:
        """Everything not yet released (call once decoding has ended)."""
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        out = self.text[self.sent : upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        return out
