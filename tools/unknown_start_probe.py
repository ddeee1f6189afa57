"""What ``serve``'s start-up judgement of ``unknown`` traffic sees: the prices behind it.

    python tools/unknown_start_probe.py --storage sqlite:///store.db \
        --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b [--max-batch N]

Builds the server as ``autotune serve`` does (``build_server``: the models at ``--precision``, the
store's routes, start-up's timings and first decodes; no port is opened), then prints what
``Control.unknown_start`` priced the server's default draft with: the plain step, one draft token
and the verify of each row count, and, at the acceptance of a route that stored none
(``DEFAULT_ACCEPTANCE``), each chain length's expected speed against plain steps. Last, the same
prices from a cost model timed afresh after start-up (the machine warm), and the judgement (a
draft starts only where priced ``ControlSettings.margin`` above plain). ``--max-batch`` as
``serve``'s (default: serve's own, which also decides whether verifies are padded).
The store is only read (its routes); use a copy where it matters.
"""
from __future__ import annotations

import argparse

import torch


def main() -> None:
    from autotune.serving.server import ServeConfig, build_server
    from autotune.store.storage import open_storage
    from autotune.tuning.controller import controller_cost
    from autotune.tuning.load import DEFAULT_ACCEPTANCE, Candidate, alone_speed_ups

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--storage", required=True)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--precision", default="auto")
    ap.add_argument("--max-batch", type=int, default=None)
    args = ap.parse_args()
    cfg = ServeConfig(model=args.model, draft=args.draft, dtype=args.precision, storage=args.storage,
                      max_batch=args.max_batch)
    with open_storage(cfg.storage) as storage:
        server = build_server(cfg, storage)
        default = server.book.default
        dec = server.worker.decoders.decoder(default)
        with torch.inference_mode():
            for label, cost in (("start-up", server.worker.control.cost(dec)), ("timed again", controller_cost(dec))):
                plain, token = cost.plain_step_s(), cost.draft_forward_s(default.layer_plan)
                print(f"{label}: plain step {plain * 1e3:.1f} ms, draft token {token * 1e3:.1f} ms, verify rows "
                      + ", ".join(f"{r}: {cost.verify_s(r) / plain:.2f}x" for r in range(2, dec.verify_width + 1)))
                ups = alone_speed_ups(Candidate.of(default, DEFAULT_ACCEPTANCE, token), cost.verify_s, plain)
                print("  at acceptance", DEFAULT_ACCEPTANCE, "against plain steps, by draft length: "
                      + ", ".join(f"{length}: {up:.3f}x" for length, up in ups))
        print("unknown ->", "default" if server.book.fallback.speculates else "plain", "(the start-up judgement)")


if __name__ == "__main__":
    main()
