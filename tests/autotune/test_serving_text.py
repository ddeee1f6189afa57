"""Streaming text deltas with OpenAI stop strings (autotune.serving.text)."""
from __future__ import annotations

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
