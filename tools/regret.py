"""Regret check of the online tuner on a small space (``chain``: plain, the draft model's chain at
lengths x thresholds, prompt lookup at lengths; a few dozen points).

1. ``autotune study --space chain`` tunes online on the task's first ``--study-limit`` prompts and
   stores its pick (a temporary SQLite store).
2. Every point of the space then decodes the next ``--limit`` prompts (unseen by the study), the
   points interleaved prompt by prompt after a warm-up, one packed target shared by all of them.
3. The report: every point's measured tokens/s, the best, the pick, and the regret
   ``1 - tps(pick) / tps(best)``; every point's output is checked identical to plain decoding.

    python tools/regret.py --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --task humaneval \\
        --study-limit 5 --limit 2 --max-new-tokens 96 --json regret.json
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune.cli.args import add_model_args, add_prompt_args  # noqa: E402
from autotune.store.storage import open_storage  # noqa: E402
from autotune.tuning.study import run_study, space_context, verify_width  # noqa: E402
from autotune.tuning.tuner import TunerSettings  # noqa: E402
from runtime.decoding import GenerationConfig  # noqa: E402
from runtime.pipeline import ModelPool, build_decoder, eos_ids  # noqa: E402
from runtime.stats import DecodeStats  # noqa: E402
from search_spaces.spaces import get_space  # noqa: E402
from studies import load_prompts, routing_text  # noqa: E402
from studies.encode import encode_prompt  # noqa: E402


def label(s) -> str:
    if not s.speculates:
        return "plain"
    if s.drafter == "prompt-lookup":
        return f"lookup k={s.draft_length}"
    return f"draft k={s.draft_length} t={s.confidence_threshold:g}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap, ["model", "draft"], model={"required": False, "default": "qwen2.5-coder-1.5b"},
                   draft={"default": "qwen2.5-coder-0.5b"})
    add_prompt_args(ap, ["task"], task={"default": "humaneval"})
    ap.add_argument("--study-limit", type=int, default=5)
    add_prompt_args(ap, ["limit", "max_new_tokens"], limit={"default": 2}, max_new_tokens={"default": 96})
    ap.add_argument("--json", dest="json_out", type=Path)
    args = ap.parse_args()

    pool = ModelPool()
    target = pool.get(args.model, "float32")
    items = load_prompts(args.task, limit=args.study_limit + args.limit)
    prompts = [encode_prompt(item, target.tokenizer) for item in items]
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, eos_token_ids=eos_ids(target))
    space = get_space("chain")
    with tempfile.TemporaryDirectory() as tmp, open_storage(f"sqlite:///{tmp}/regret.db") as storage:
        report = run_study(pool, target, args.draft, args.task, prompts[: args.study_limit], cfg, storage, space.name,
                           TunerSettings(), prompt_texts=[routing_text(i) for i in items[: args.study_limit]])
    pick = report.chosen
    ctx = space_context(space, target, pool.get(args.draft, "float32"), 0.45)
    points = space.points(ctx)
    width = verify_width(space, ctx)
    decoders = {label(s): build_decoder(pool, target, s, args.draft if s.drafter == "draft-model" else None,
                                        verify_width=width if s.speculates else None) for s in points}
    unseen = prompts[args.study_limit:]
    warm = GenerationConfig(max_new_tokens=8, eos_token_ids=cfg.eos_token_ids)
    for dec in decoders.values():
        dec.generate(unseen[0], warm)
    stats = {name: DecodeStats() for name in decoders}
    outputs: dict[str, list[list[int]]] = {name: [] for name in decoders}
    for ids in unseen:
        for name, dec in decoders.items():
            run = dec.generate(ids, cfg)
            stats[name] = stats[name].merge(run.stats)
            outputs[name].append(run.tokens)
            print(f"{name:>22}: {run.stats.tokens_per_s:6.2f} tok/s", file=sys.stderr)
    tps = {name: s.tokens_per_s for name, s in stats.items()}
    best = max(tps, key=tps.get)
    regret = 1.0 - tps[label(pick)] / tps[best]
    result = {
        "task": args.task, "study_prompts": args.study_limit, "measured_prompts": len(unseen),
        "max_new_tokens": args.max_new_tokens, "points": len(points), "pick": label(pick),
        "pick_strategy": pick.to_dict(), "best": best, "regret": regret,
        "tokens_per_s": dict(sorted(tps.items(), key=lambda kv: -kv[1])),
        # verify rounds per point (after the prefill): with identical outputs, fewer rounds is the text's
        # part of a speed difference, the rest is round cost (and this machine's noise)
        "rounds": {name: s.target_forwards - len(unseen) for name, s in stats.items()},
        "identical": all(outputs[name] == outputs["plain"] for name in outputs),
        "study": {"tuning_share": report.tuning_share,
                  **{k: report.tuner.get(k) for k in ("trials", "swept", "windows", "measured_trials", "stop_reason",
                                                      "switches", "kept", "rejected", "reverted")}},
    }
    for name, value in result["tokens_per_s"].items():
        mark = " <- pick" if name == result["pick"] else (" <- best" if name == best else "")
        print(f"{name:>22}  {value:6.2f} tok/s  {result['rounds'][name]:4d} rounds{mark}")
    print(f"pick {result['pick']}, best {best}: regret {100 * regret:.1f}% over {len(points)} points; "
          f"outputs identical: {result['identical']}")
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
