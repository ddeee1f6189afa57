"""Few-shot prompt builders."""
from __future__ import annotations

from collections.abc import Sequence


def question_answer_shots(
    exemplars: Sequence[tuple[str, str]], question: str, q_label: str = "Question", a_label: str = "Answer"
) -> str:
    """``"Question: q\\nAnswer: a\\n\\n"`` per exemplar, then ``"Question: {question}\\nAnswer:"``."""
    shots = "".join(f"{q_label}: {q}\n{a_label}: {a}\n\n" for q, a in exemplars)
    return f"{shots}{q_label}: {question}\n{a_label}:"
