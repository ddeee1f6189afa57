"""A study's held-out prompts decoded with prompt lookup, beside what the tuner's replays of the same
outputs count: the walk over the whole output (``lookup_walk``, how the held-out text and the tuned
outputs are priced) and the window replay's phase average (``lookup_rounds``, how a window in the
stream is scored). The walk must give the decode's forwards, drafted and accepted tokens.

    AUTOTUNE_DATA_DIR=../shared/data python tools/lookup_walk.py [--task humaneval] [--limit 10] [--k 11]
"""
from __future__ import annotations

import argparse

from autotune.cli.inputs import fitting_prompts, prompt_items
from autotune.cli.main import build_parser
from autotune.tuning.heldout import split_prompts
from autotune.tuning.matchness import lookup_match
from autotune.tuning.objective import lookup_rounds, lookup_walk
from runtime.pipeline import ModelPool, build_decoder
from search_spaces.strategy import Strategy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--task", default="humaneval")
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=11, help="prompt lookup's draft length")
    parser.add_argument("--horizon", type=int, default=12, help="the window replay's horizon (the space's longest draft)")
    args = parser.parse_args()
    study = build_parser().parse_args(["study", "--model", args.model, "--task", args.task, "--limit", str(args.limit),
                                       "--max-new-tokens", str(args.max_new_tokens)])
    pool = ModelPool()
    target = pool.get(study.model, study.precision)
    prompts, cfg = fitting_prompts(study, pool, target, prompt_items(study))
    decoder = build_decoder(pool, target, Strategy(drafter="prompt-lookup", draft_length=args.k), None)
    print("| held-out prompt | decode: forwards / drafted / accepted | walk: rounds + 1 / drafted / accepted "
          "| tokens a round, walk | tokens a round, phases averaged | plain share, walk | plain share, phases averaged |")
    print("|---|---|---|---|---|---|---|")
    for i in split_prompts(len(prompts))[1]:
        ids = prompts[i][1]
        got = decoder.generate(ids, cfg)
        n, s = len(got.tokens), got.stats
        match = lookup_match(ids + got.tokens, n, args.horizon)
        walk = lookup_walk(match, args.k)
        phased = lookup_rounds(match, args.k, args.horizon)
        weight = sum(w for _, _, w in phased)
        print(f"| {i} | {s.target_forwards} / {s.drafted} / {s.accepted} "
              f"| {len(walk) + 1} / {sum(p for _, p, _ in walk)} / {sum(a for a, p, _ in walk if p)} "
              f"| {(n - 1) / len(walk):.2f} | {sum(w * (a + 1) for a, _, w in phased) / weight:.2f} "
              f"| {sum(1 for _, p, _ in walk if p == 0) / len(walk):.2f} "
              f"| {sum(w for _, p, w in phased if p == 0) / weight:.2f} |")


if __name__ == "__main__":
    main()
