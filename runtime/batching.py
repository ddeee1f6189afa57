"""Continuous batching: several sequences, each with its own decoder (strategy, drafter state), KV
cache and random source, advance together by one round per step.

A step drafts for every sequence with its own drafter (the draft forwards of sequences that share
a model and a layer plan run as one batched forward per depth: ``draft_together``), then verifies every sequence's rows (1 for
plain decoding, ``1 + N`` for a chain, a tree or a lookup copy) in **one** target forward
(``CausalLM.forward_batch``: ragged rows, a mask per sequence), then accepts per sequence with the
single-sequence rules and that sequence's generator, reading every result back in one ``tolist``.
Sequences join (``Decoder.start``: a prefill; or ``Decoder.start_steps``, a chunk per round, its chunks
riding the rounds' target forwards where rows are reusable) and leave between steps.

A sequence alone runs its decoder's own round, exactly what ``Decoder.generate`` runs.
"""
from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass

import torch

from runtime.decoding import Decoder, GenerationConfig, GenerationResult, Sequence
from runtime.draft import Draft, DraftSteps, Forward
from runtime.layout import PromptChunk
from runtime.transformer import BatchPart, CausalLM


@dataclass(eq=False)
class Rider:
    """A prompt chunk riding in a batch round's target forward (``batch_round``): its rows go in
    beside the members' and out come its logits and its share of the forward's time (by rows)."""

    chunk: PromptChunk
    logits: torch.Tensor | None = None
    seconds: float = 0.0


@dataclass
class Member:
    """A sequence in the batch and the decoder whose drafters follow it."""

    decoder: Decoder
    seq: Sequence


def draft_together(all_steps: list[DraftSteps]) -> list[Draft]:
    """Run several drafters' steps in lockstep -> their drafts. Each time every drafter still
    drafting has asked for its next forward, the forwards over one model's weights under one layer
    plan (a draft model's chain or tree steps; self-drafters skipping the same layers of a shared
    target) run as one batched forward; the others one by one (a lone forward, a recorder, groups
    spread over ranks by the ``distributed`` executor)."""
    drafts: list[Draft | None] = [None] * len(all_steps)
    waiting: dict[int, Forward] = {}

    def advance(i: int, logits: torch.Tensor | None) -> None:
        try:
            waiting[i] = all_steps[i].send(logits) if logits is not None else next(all_steps[i])
        except StopIteration as done:
            drafts[i] = done.value

    for i in range(len(all_steps)):
        advance(i, None)
    while waiting:
        asked, groups = dict(waiting), {}
        waiting.clear()
        for i, f in asked.items():
            alone = f.model.recorder is not None or (f.plan is not None and f.model.group_executor != "batched")
            key = ("alone", i) if alone else (id(f.model.linears), id(f.model.head), f.plan)
            groups.setdefault(key, []).append(i)
        for members in groups.values():
            if len(members) == 1:
                advance(members[0], asked[members[0]].run())
                continue
            first = asked[members[0]]
            outs = first.model.forward_batch([BatchPart(asked[i].tokens, asked[i].cache, asked[i].positions,
                                                        asked[i].rel_mask, asked[i].logits_for) for i in members],
                                             plan=first.plan)
            for i, logits in zip(members, outs):
                advance(i, logits)
    return [d for d in drafts if d is not None]


def batch_round(target: CausalLM, members: list[Member], riders: Collection[Rider] = ()) -> list[list[int]]:
    """One round for every member -> the tokens each one appended (>= 1 each; ``seq.out`` grows).

    ``target`` runs the batched forward: a wrapper of the members' target model (its linear backend
    decides how the rows are computed; ``runtime.linear.run_rows``). Each member's stats get its own
    drafting time and the shared verify time. ``riders``: prompt chunks of sequences being started
    (``Decoder.start_steps``) that run in the same target forward; only on a target whose rows are
    reusable (``CausalLM.rows_reusable``: a chunk's rows come out bit for bit as its lone prefill's)."""
    if riders and not target.rows_reusable:
        raise ValueError("prompt chunks ride in a batched forward only on a target whose rows are reusable")
    if not members:
        raise ValueError("a batch round needs at least one member")
    if len(members) == 1 and not riders:
        m = members[0]
        seq = m.seq
        with torch.inference_mode():
            new = m.decoder._round(seq.out, seq.cache, seq.config, seq.gen, seq.stats, seq.eos)
        seq.out.extend(new)
        return [new]
    with torch.inference_mode():
        t0 = time.perf_counter()
        drafts = draft_together([m.decoder.propose_steps(m.seq.out, m.seq.config, m.seq.gen) for m in members])
        t1 = time.perf_counter()
        drafting = [m for m, d in zip(members, drafts) if d.tokens.numel()]
        for m in drafting:  # the drafting forwards were shared: each sequence gets its share
            m.seq.stats.draft_s += (t1 - t0) / len(drafting)
        rows = [m.decoder.rows(m.seq.out[-1], d, m.seq.cache, pad=False) for m, d in zip(members, drafts)]
        forward = time.perf_counter()
        logits = target.forward_batch([BatchPart(r.ids, m.seq.cache, r.positions, r.rel_mask)
                                       for m, r in zip(members, rows)] + [c.chunk.part for c in riders])
        forward = time.perf_counter() - forward
        all_rows = sum(int(r.ids.shape[0]) for r in rows) + sum(c.chunk.rows for c in riders)
        for c, lg in zip(riders, logits[len(members):]):
            c.logits, c.seconds = lg, forward * c.chunk.rows / all_rows
        results = [Decoder.judge(r, lg[: r.n].float(), d, m.seq.config.sampling, m.seq.gen)
                   for m, r, lg, d in zip(members, rows, logits, drafts)]
        got = torch.cat(results).tolist()  # the step's one host read
        verify_s = time.perf_counter() - t1
        appended = []
        at = 0
        for m, r, d, res in zip(members, rows, drafts, results):
            mine, at = got[at : at + res.numel()], at + res.numel()
            path, new = Decoder.settle(r, mine, m.seq.cache)
            new = m.decoder.conclude(d, path, new, m.seq.stats, m.seq.eos)
            m.seq.stats.verify_s += verify_s
            m.seq.out.extend(new)
            appended.append(new)
    return appended


@dataclass(frozen=True)
class BatchRequest:
    """One prompt of ``generate_batch``: its decoder (not shared with another request), prompt,
    config, and the step at which it joins the running batch (0: from the start)."""

    decoder: Decoder
    prompt: list[int]
    config: GenerationConfig
    joins_at: int = 0


def generate_batch(target: CausalLM, requests: list[BatchRequest]) -> list[GenerationResult]:
    """Decode every request, continuously batched: a request joins at its step (its prefill runs
    between steps), leaves when it is finished, and the others go on -> results in request order."""
    if len({id(r.decoder) for r in requests}) != len(requests):
        raise ValueError("each request of a batch needs its own decoder (its drafters follow one sequence)")
    results: list[GenerationResult | None] = [None] * len(requests)
    waiting = sorted(range(len(requests)), key=lambda i: requests[i].joins_at)
    running: list[tuple[int, Member]] = []
    step = 0
    while waiting or running:
        while waiting and requests[waiting[0]].joins_at <= step:
            i = waiting.pop(0)
            r = requests[i]
            seq = r.decoder.start(r.prompt, r.config)
            r.decoder.draft_prefill(seq)  # the drafting model's catch-up over the prompt, as in generate
            running.append((i, Member(r.decoder, seq)))
        live = [(i, m) for i, m in running if not m.seq.finished]
        for i, m in running:
            if m.seq.finished:
                results[i] = m.seq.result()
        running = live
        if running:
            batch_round(target, [m for _, m in running])
        step += 1
    return [r for r in results if r is not None]
