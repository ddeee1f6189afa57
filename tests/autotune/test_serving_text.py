"""Streaming text deltas with OpenAI stop strings (autotune.serving.text)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autotune.serving.text import TextStream


class CharTokenizer:
    """Token i is the character chr(i); 0xFFFD marks a partial character, as HF decode shows it."""

    def decode(self, tokens, skip_special_tokens=True):
        return "".join(chr(t) for t in tokens)


def run(text: str, stops: list[str], rounds: list[int]) -> tuple[str, list[str], bool]:
    stream, parts, tokens = TextStream(CharTokenizer(), stops), [], [ord(c) for c in text]
    end = 0
    for n in rounds:
        end = min(len(tokens), end + n)
        parts.append(stream.push(tokens[:end]))
        if stream.stopped:
            break
    if not stream.stopped:
        parts.append(stream.push(tokens))
    parts.append(stream.finish())
    return "".join(parts), parts, stream.stopped


def test_stop_string_cuts_the_text_before_it():
    out, parts, stopped = run("The answer is 42.\nQ: next", ["\nQ:"], [3, 3, 3, 3, 3, 3, 3, 3])
    assert stopped and out == "The answer is 42."
    assert all("\n" not in p for p in parts)  # the stop string's start was held back, never streamed


def test_without_stops_everything_streams():
    out, parts, stopped = run("hello world", [], [1, 4, 6])
    assert not stopped and out == "hello world" and parts[0] == "h"


def test_partial_character_is_held_back():
    stream = TextStream(CharTokenizer(), [])
    assert stream.push([ord("a"), 0xFFFD]) == "a"
    assert stream.push([ord("a"), ord("é")]) == "é"


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="ab\nQ:", max_size=30), stop=st.sampled_from(["\nQ:", "ab", "b\n", "QQ"]),
       rounds=st.lists(st.integers(1, 5), min_size=1, max_size=30))
def test_streamed_text_equals_whole_text_cut_at_the_first_stop(text, stop, rounds):
    out, _, stopped = run(text, [stop], rounds)
    cut = text.find(stop)
    assert out == (text[:cut] if cut >= 0 else text)
    assert stopped == (cut >= 0)


@pytest.fixture(scope="module")
def smollm_tokenizer(smollm):
    return smollm.tokenizer


class CountingTokenizer(CharTokenizer):
    """Counts the tokens it is asked to decode."""

    def __init__(self) -> None:
        self.decoded = 0

    def decode(self, tokens, skip_special_tokens=True):
        self.decoded += len(tokens)
        return super().decode(tokens, skip_special_tokens)


def _decoded_per_token(n: int) -> float:
    tok = CountingTokenizer()
    stream, tokens = TextStream(tok, ["\nQ:"]), [ord("ab"[i % 2]) for i in range(n)]
    out = "".join(stream.push(tokens[: i + 1]) for i in range(n)) + stream.finish()
    assert out == "ab" * (n // 2)
    return tok.decoded / n


def test_each_round_decodes_only_its_new_tokens():
    """Decoding work grows linearly with the output (a whole decode each round grew quadratically)."""
    assert _decoded_per_token(100) <= 4 and _decoded_per_token(1000) <= 4


def test_partial_characters_wait_for_their_next_round():
    """A window ending in U+FFFD is decoded again with the next tokens, never released."""
    tok = CountingTokenizer()
    stream = TextStream(tok, [])
    assert stream.push([ord("a"), 0xFFFD]) == "a"
    assert stream.push([ord("a"), 0xFFFD, 0xFFFD]) == ""
    assert stream.push([ord("a"), ord("é"), ord("b")]) == "éb" and stream.finish() == ""


def test_the_completion_tokens_end_at_the_stop_string():
    stream = TextStream(CharTokenizer(), ["\nQ:"])
    tokens = [ord(c) for c in "The answer is 42.\nQ: next"]
    assert stream.push(tokens[:15]) == "The answer is 4" and stream.n_tokens is None
    stream.push(tokens)  # one round past the stop string
    assert stream.stopped and stream.text == "The answer is 42."
    assert stream.n_tokens == len("The answer is 42.\nQ:")


@pytest.mark.slow
@settings(max_examples=50, deadline=None)
@given(rounds=st.lists(st.integers(1, 4), min_size=1, max_size=60))
def test_a_real_tokenizer_streams_its_whole_decode(smollm_tokenizer, rounds):
    """SmolLM2's byte-level BPE: multi-byte characters split across tokens, leading spaces."""
    tok = smollm_tokenizer
    text = "naïve café: 世界 🎉🎉 — ok!\n  def f(x):  return x ** 2  # ünïcödé 日本語"
    tokens = tok.encode(text, add_special_tokens=False)
    stream, parts, end = TextStream(tok, []), [], 0
    for n in rounds:
        end = min(len(tokens), end + n)
        parts.append(stream.push(tokens[:end]))
    parts += [stream.push(tokens), stream.finish()]
    assert "".join(parts) == tok.decode(tokens, skip_special_tokens=True)
    assert not any("\ufffd" in p for p in parts)
