"""Generated tokens -> text deltas for streaming, with OpenAI ``stop`` strings.

Each round decodes only its new tokens (``skip_special_tokens``, exactly what ``autotune
generate`` prints), in a window that starts at the previous round's tokens, so that a tokenizer's
leading-space rule sees the context a whole decode sees (vLLM's incremental detokenizer): the text
grows by what the window adds to the decode of its first tokens. A window that ends in a partial
UTF-8 character (U+FFFD) is decoded again, with the next round's tokens, until it is whole. Only
what is certain is released: not a trailing partial character, and not a tail that could still
become a stop string. A stop string ends the text before it (OpenAI semantics), stops decoding,
and ends the completion's tokens at the one that completed it (``n_tokens``).
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
    n_tokens: int | None = None  # once stopped: the tokens through the one that completed the stop string
    done: str = ""  # the text of tokens[:read], whole characters only (searched for stops already)
    start: int = 0  # the window's first token
    read: int = 0  # tokens whose text is in ``done``

    def push(self, tokens: list[int]) -> str:
        """The new tokens so far -> the text to release now (may be empty)."""
        if self.stopped:
            return ""
        added, whole = self._added(tokens, len(tokens))
        text = self.done + added
        cut, stop = self._find_stop(text, max(len(self.done) - max(map(len, self.stops), default=0) + 1, 0))
        if cut >= 0:
            self.n_tokens = self._tokens_through(tokens, cut + len(stop))
            self.text, self.stopped = text[:cut], True
            return self._release(len(self.text))
        self.text = text
        if whole:  # the next window starts at this round's tokens
            self.done, self.start, self.read = text, self.read, len(tokens)
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

    def _added(self, tokens: list[int], end: int) -> tuple[str, bool]:
        """The text tokens[read:end] add to ``done``, and whether it ends in a whole character."""
        if end <= self.read:
            return "", True
        decode = self.tokenizer.decode
        prefix = decode(tokens[self.start : self.read], skip_special_tokens=True) if self.read > self.start else ""
        window = decode(tokens[self.start : end], skip_special_tokens=True)
        return window[len(prefix) :], not window.endswith("\ufffd")

    def _find_stop(self, text: str, start: int) -> tuple[int, str]:
        """The first stop string in ``text`` from ``start`` (the shortest of those starting there)."""
        found = [(i, len(s), s) for s in self.stops if (i := text.find(s, start)) >= 0]
        return (min(found)[0], min(found)[2]) if found else (-1, "")

    def _tokens_through(self, tokens: list[int], end: int) -> int:
        """The fewest tokens whose text reaches character ``end`` (decoded once, when a stop is met)."""
        for n in range(self.read + 1, len(tokens)):
            if len(self.done) + len(self._added(tokens, n)[0]) >= end:
                return n
        return len(tokens)

    def _release(self, upto: int) -> str:
        out = self.text[self.sent : upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        return out
