"""A long prompt joining a running batch, its chunks run alone before each step against riding in
the step's target forward (``runtime.batching.batch_round(..., riders)``), side by side in one run:
the packaged model at ``--precision``, ``--batch`` requests decoding plainly while a GSM8K prompt
(5-shot, ~760 tokens) is prefilled in chunks of each ``--chunks`` size, one chunk per step. Reports
the prefill phase's wall time (every chunk and the step beside it), what the running requests wait
per step (their inter-token time), and the joining request's time to its first token; the fastest
of ``--repeats`` rounds, the two ways alternating. Both ways give bit-identical rows (checked).

    python tools/prompt_riders.py [--model qwen2.5-coder-1.5b] [--precision gguf] [--batch 4] [--chunks 64,512]
"""
from __future__ import annotations

import argparse
import time

import torch

from autotune.measure.profile import served_lm
from runtime.batching import Member, Rider, batch_round
from runtime.decoding import Decoder, GenerationConfig
from runtime.pipeline import ModelPool
from studies import load_prompts


def _phase(lm, prompt: list[int], mates: list[list[int]], chunk: int, ride: bool) -> tuple[float, int, float, object]:
    """The running requests started, then the prompt prefilled a chunk per step, the running requests
    stepping once per chunk -> (wall s, steps, s to the prompt's first token, its sequence)."""
    cfg = GenerationConfig(max_new_tokens=400, prefill_chunk=chunk)
    members = []
    for ids in mates:
        dec = Decoder(lm)
        members.append(Member(dec, dec.start(ids, cfg)))
    steps = Decoder(lm).start_steps(prompt, cfg)
    chunk_part, rounds = next(steps), 0
    started = time.perf_counter()
    while True:
        if ride:
            rider = Rider(chunk_part)
            batch_round(lm, members, [rider])
            sent = (rider.logits, rider.seconds)
        else:
            sent = None
        rounds += 1
        try:
            chunk_part = steps.send(sent)
        except StopIteration as done:
            seq, first = done.value, time.perf_counter() - started
            break
        if not ride:
            batch_round(lm, members)
    if not ride:  # the step after the last chunk alone, as the loop runs it before the request joins
        batch_round(lm, members)
    return time.perf_counter() - started, rounds, first, seq


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--precision", default="gguf")
    parser.add_argument("--batch", type=int, default=4, help="requests decoding while the prompt is prefilled")
    parser.add_argument("--chunks", default="64,512", help="comma list of prefill chunk sizes")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    model = ModelPool().get(args.model, args.precision)
    lm = served_lm(model)
    if not lm.rows_reusable:
        raise SystemExit(f"{args.model} at {args.precision}: rows are not reusable, no chunk can ride")
    tok = model.tokenizer
    prompt = tok(load_prompts("gsm8k", None, 1)[0].text)["input_ids"]
    mates = [tok(p.text)["input_ids"] for p in load_prompts("humaneval", None, args.batch)]
    print(f"{args.model} at {args.precision}, {torch.get_num_threads()} threads; a {len(prompt)}-token prompt "
          f"joins {args.batch} running requests\n")
    print("| chunk | way | prefill phase s | steps | per step s | first token after s | rows identical |")
    print("|---|---|---|---|---|---|---|")
    for chunk in (int(c) for c in args.chunks.split(",")):
        best: dict[bool, tuple[float, int, float]] = {}
        seqs = {}
        for _ in range(args.repeats):
            for ride in (False, True):
                wall, rounds, first, seq = _phase(lm, prompt, mates, chunk, ride)
                if ride not in best or wall < best[ride][0]:
                    best[ride] = (wall, rounds, first)
                seqs[ride] = seq
        n = len(prompt)
        same = all(torch.equal(getattr(seqs[True].cache, a)[:, :, :n], getattr(seqs[False].cache, a)[:, :, :n])
                   for a in ("all_keys", "all_values")) and seqs[True].out == seqs[False].out
        for ride in (False, True):
            wall, rounds, first = best[ride]
            print(f"| {chunk} | {'in steps' if ride else 'alone'} | {wall:.2f} | {rounds} | {wall / rounds:.2f} | "
                  f"{first:.2f} | {'yes' if same else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
