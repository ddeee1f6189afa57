"""The router's terms, and routing texts stored as hashed terms rather than text.

The task router (``router``) compares texts by the TF-IDF weights of their terms: lower-cased words
and single punctuation marks (``TOKEN_PATTERN``), order ignored. Each term enters the vectors as a
short hash of itself (``term``), so a routing text can be stored as its **term counts**
(``as_terms``: ``"autotune-terms/v1: 3f9a01c2*3 0b77e415 ..."``) and still be routed against
exactly as its text would be. That is what ``autotune serve --adaptive`` stores for the requests a
route was re-tuned or created on, unless ``--store-prompts`` asks for the text: the words' order is
gone and each word is a 32-bit hash, so the text cannot be read back (a dictionary of candidate
words can still be hashed and tested one by one: treat the terms as sensitive, not as public).

Stored studies' prompts (public data sets, or a file the user chose) stay text; both kinds mix in one
fitted router.
"""
from __future__ import annotations

import hashlib
import re
from collections import Counter
from functools import lru_cache

from autotune.store.records import clip_prompt

TOKEN_PATTERN = r"(?u)\b\w+\b|[^\w\s]"  # words (any length) and single punctuation marks: code, math, prose
TERMS_PREFIX = "autotune-terms/v1:"
_TOKEN = re.compile(TOKEN_PATTERN)
_STORED_TERM = re.compile(r"([0-9a-f]{8})(?:\*(\d{1,6}))?")


@lru_cache(maxsize=1 << 16)
def term(word: str) -> str:
    """A lower-cased word's hashed term (8 hex digits)."""
    return hashlib.blake2b(word.encode(), digest_size=4, person=b"autotune-route").hexdigest()


def words(text: str) -> list[str]:
    """``text``'s lower-cased words and punctuation marks, in order."""
    return _TOKEN.findall(text.lower())


def terms(text: str) -> list[str]:
    """The hashed terms of a routing text, or of a stored ``as_terms`` string (one per occurrence):
    the analyzer of the router's TF-IDF vectors."""
    if text.startswith(TERMS_PREFIX):
        out: list[str] = []
        for match in _STORED_TERM.finditer(text, len(TERMS_PREFIX)):  # a clipped tail is skipped, not misread
            out += [match.group(1)] * int(match.group(2) or 1)
        return out
    return [term(w) for w in words(text)]


def as_terms(text: str) -> str:
    """``text`` as a stored string of its hashed term counts, most frequent first (routed against
    exactly as ``text`` is; bounded like a stored prompt: the text is clipped first)."""
    counts = Counter(terms(clip_prompt(text)))
    body = " ".join(t if n == 1 else f"{t}*{n}" for t, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    return clip_prompt(f"{TERMS_PREFIX} {body}")
