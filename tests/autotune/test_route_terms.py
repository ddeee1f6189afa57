"""Routing texts stored as hashed term counts (``autotune.serving.routing.terms``): they route
exactly as their text does, hold none of its words, and survive the store's clipping."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from autotune.serving.routing.router import RouteEntry, TaskRouter
from autotune.serving.routing.terms import TERMS_PREFIX, as_terms, terms
from autotune.store.records import PROMPT_CHARS, clip_prompt
from search_spaces.strategy import PLAIN
from tests.helpers import TRANSLATE, routing_texts


def _router(prompts_by_task: dict[str, list[str]]) -> TaskRouter:
    entries = [RouteEntry(task=t, best_id=i, strategy=PLAIN, prompts=tuple(p))
               for i, (t, p) in enumerate(prompts_by_task.items())]
    return TaskRouter().fit(entries)


def test_stored_terms_route_exactly_as_their_text():
    texts = {"translate": TRANSLATE[:6], "code": routing_texts("humaneval", 6, 0), "math": routing_texts("gsm8k", 6, 0)}
    hashed = {task: [as_terms(t) for t in prompts] for task, prompts in texts.items()}
    queries = TRANSLATE[6:9] + routing_texts("humaneval", 3, 10) + routing_texts("gsm8k", 3, 10)
    np.testing.assert_allclose(_router(hashed).distances(queries), _router(texts).distances(queries), atol=1e-12)


def test_stored_terms_hold_no_word_of_the_text():
    text = "Translate this sentence into French, keeping its tone: the cat sat on the mat."
    stored = as_terms(text)
    assert stored.startswith(TERMS_PREFIX)
    assert not any(w in stored.lower() for w in ("translate", "french", "cat", "mat", "tone"))
    assert sorted(terms(stored)) == sorted(terms(text))  # the same bag of terms, order gone


@settings(max_examples=30, deadline=None)
@given(st.lists(st.text(alphabet="abcdefghij klm,.;()", min_size=1, max_size=12), min_size=1, max_size=800))
def test_a_clipped_terms_string_still_parses_to_terms_of_the_text(words):
    text = " ".join(words)
    stored = as_terms(text)
    assert len(stored) <= PROMPT_CHARS and clip_prompt(stored) == stored
    assert set(terms(stored)) <= set(terms(text))  # clipping drops terms, never misreads one
