"""A request's answer from the decode thread: streamed text between rounds, the final outcome, and an
answer that waits for its re-tune's check and store write."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

from autotune.serving.jobs import CHECK_HOLD_S, HOLD_S, Job, Outcome
from runtime.decoding import GenerationResult


def after_round(job: Job, tokens: list[int]) -> bool:
    """After the prefill and each round: time to first token, streamed text -> True when the
    request stops here (a stop string, or its client left)."""
    if job.first_token_at is None:
        job.first_token_at = time.perf_counter()
    # text is decoded between rounds only when someone reads it then: a streaming client, or
    # stop strings that may end decoding early; otherwise once, at the end
    if job.streamed or job.stream.stops:
        _release(job, job.stream.push(tokens))
    return job.stream.stopped or job.cancelled.is_set()


def complete(job: Job, result: GenerationResult, on_done: Callable[[Job, Outcome], None] | None) -> None:
    """``job`` decoded ``result``: its last text, its outcome to ``on_done``, and its answer."""
    _release(job, job.stream.push(result.tokens) + job.stream.finish())
    ended = job.stream.stopped or (result.tokens and result.tokens[-1] in job.cfg.eos_token_ids)
    now = time.perf_counter()
    outcome = Outcome(
        text=job.stream.text, tokens=list(result.tokens[: job.stream.n_tokens]), stats=result.stats,  # to the stop
        finish_reason="stop" if ended else "length",
        ttft_s=(job.first_token_at or now) - job.accepted_at, latency_s=now - job.accepted_at,
    )
    if on_done is not None:
        on_done(job, outcome)
    _answer(job, outcome)


def _answer(job: Job, outcome: Outcome) -> None:
    hold = job.hold
    if hold is None or hold.is_set():
        job.emit("done", outcome)
        return

    def answer_when_stored() -> None:  # off the decode thread: it goes on with the next request
        if job.checked is not None:
            job.checked.wait(CHECK_HOLD_S)
        hold.wait(HOLD_S)
        job.emit("done", outcome)

    threading.Thread(target=answer_when_stored, name="autotune-answer", daemon=True).start()


def _release(job: Job, text: str) -> None:
    if text and job.streamed:
        job.emit("delta", text)
