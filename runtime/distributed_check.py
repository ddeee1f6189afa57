"""Check the ``distributed`` group executor end to end on a tiny random model.

    torchrun --nproc-per-node 2 -m runtime.distributed_check --out FILE

Every rank builds the same tiny model (fixed seed), drafts greedily under EasySpec plans
(``easyspec_plan(n_layers, N)`` for each ``--lp-sizes`` entry) with ``lm.group_executor =
"distributed"``: a prefill of the prompt under the plan, ``--n-new`` single-token steps, then one
tree step (the top-3 candidates of the last logits as siblings, a tree attention mask). Rank 0
writes JSON to FILE: per plan the draft tokens, the logits each token was picked from, the tree
step's logits, and ``max_rank_diff``, the largest difference between any rank's logits and rank 0's
(0.0 when the ranks agree exactly). ``tests/runtime/test_distributed.py`` compares it with the
same drafting in one process under the ``batched`` executor (:func:`greedy_draft`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from runtime.kv_cache import KVCache
from runtime.layout import Layout
from runtime.transformer import CausalLM
from search_spaces.layer_plan import LayerPlan, easyspec_plan

TREE_WIDTH = 3


def build_lm(family: str = "llama", seed: int = 0, layers: int = 8, vocab: int = 96) -> CausalLM:
    from runtime.testing import tiny_model

    return CausalLM(tiny_model(family, seed, vocab=vocab, layers=layers))


def prompt_tokens(seed: int, length: int, vocab: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed + 1000)
    return torch.randint(0, vocab, (length,), generator=gen).tolist()


@torch.inference_mode()
def greedy_draft(lm: CausalLM, prompt: list[int], n_new: int, plan: LayerPlan | None) -> dict[str, Any]:
    """Prefill + ``n_new`` greedy single-token steps + one tree step, all under ``plan``.

    Returns ``tokens`` (list), ``logits`` ``[n_new, V]`` (row i: what token i was picked from)
    and ``tree_logits`` ``[TREE_WIDTH, V]``."""
    dev = lm.device
    cache: KVCache = lm.new_cache(len(prompt) + n_new + TREE_WIDTH)
    ids = torch.tensor(prompt, dtype=torch.long, device=dev)
    logits = lm(ids, cache, logits_for=slice(-1, None), plan=plan).float()
    tokens: list[int] = []
    rows = []
    for step in range(n_new):
        rows.append(logits[0])
        tokens.append(int(logits[0].argmax()))
        if step + 1 < n_new:
            logits = lm(torch.tensor(tokens[-1:], device=dev), cache, plan=plan).float()
    # tree step: the last token's top candidates as siblings, each sees the prefix and itself
    last = lm(torch.tensor(tokens[-1:], device=dev), cache, plan=plan).float()[0]
    cand = torch.topk(last, TREE_WIDTH).indices
    start = cache.length
    mask = torch.zeros(TREE_WIDTH, start + TREE_WIDTH, dtype=torch.bool, device=dev)
    mask[:, :start] = True
    mask[:, start:] = torch.eye(TREE_WIDTH, dtype=torch.bool, device=dev)
    positions = torch.full((TREE_WIDTH,), start, dtype=torch.long, device=dev)
    tree = lm(cand.to(dev), cache, Layout.explicit(mask, positions), plan=plan).float()
    return {"tokens": tokens, "logits": torch.stack(rows), "tree_logits": tree}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime.distributed_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="JSON file rank 0 writes")
    p.add_argument("--family", default="llama", choices=("llama", "qwen2"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=12)
    p.add_argument("--n-new", type=int, default=8)
    p.add_argument("--lp-sizes", default="2,3")
    args = p.parse_args(argv)

    import torch.distributed as dist

    from runtime.distributed import init_from_env, local_device

    rank, world = init_from_env()
    lm = build_lm(args.family, args.seed, args.layers)
    device = local_device()
    if device.type != "cpu":
        lm = CausalLM(lm.hf_model.to(device))
    lm.group_executor = "distributed"
    prompt = prompt_tokens(args.seed, args.prompt_len, lm.dims.vocab)
    report: dict[str, Any] = {
        "world_size": world, "backend": dist.get_backend(), "family": args.family, "seed": args.seed,
        "layers": args.layers, "prompt": prompt, "n_new": args.n_new, "plans": {},
    }
    for lp in (int(x) for x in args.lp_sizes.split(",")):
        plan = easyspec_plan(args.layers, lp)
        out = greedy_draft(lm, prompt, args.n_new, plan)
        both = torch.cat([out["logits"], out["tree_logits"]]).contiguous()
        gathered = [torch.empty_like(both) for _ in range(world)]
        dist.all_gather(gathered, both)
        report["plans"][str(lp)] = {
            "plan": plan.to_dict(),
            "tokens": out["tokens"],
            "logits": out["logits"].cpu().tolist(),
            "tree_logits": out["tree_logits"].cpu().tolist(),
            "max_rank_diff": max(float((g - both).abs().max()) for g in gathered),
        }
    if rank == 0:
        tmp = args.out.with_suffix(args.out.suffix + ".tmp")
        tmp.write_text(json.dumps(report))
        tmp.replace(args.out)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # Leave without interpreter finalisation: the check is complete (report written, barrier passed,
    # process group destroyed), and tearing down torch's C++ state at exit can abort a gloo rank with
    # "terminate called without an active exception" (worker threads still holding work objects while
    # the interpreter finalises; pytorch/pytorch#190489, #179291). CI saw both ranks abort there once.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
