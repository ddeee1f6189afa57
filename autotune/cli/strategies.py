"""``autotune strategies list | show | delete | export``: the stored best strategies.

Export formats (``json``, ``hf``, ``vllm``) and what each cannot express: :mod:`autotune.store.export`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autotune.errors import CliError, StorageError
from autotune.store.export import EXPORT_FORMATS, export_strategy


def add_parser(sub: Any) -> None:
    """Register ``strategies`` and its sub-commands on the top-level sub-parser action."""
    p = sub.add_parser("strategies", help="list, show, delete or export stored tuned strategies")
    actions = p.add_subparsers(dest="strategies_command", required=True)
    ls = actions.add_parser("list", help="the best strategy stored per model, draft, task and hardware")
    ls.add_argument("--model", help="only this model (model id, or the alias before '@')")
    ls.add_argument("--task", help="only this task")
    show = actions.add_parser("show", help="one stored strategy in full")
    delete = actions.add_parser("delete", help="forget a stored best strategy (its history stays)")
    export = actions.add_parser("export", help="write a stored strategy as JSON, HF generation_config or vLLM config")
    for action in (show, delete, export):
        action.add_argument("id", type=int, help="the id shown by `autotune strategies list`")
    export.add_argument("--format", choices=EXPORT_FORMATS, default="json", help="json (default), hf or vllm")
    export.add_argument("--output", type=Path, help="write to this file instead of stdout")
    export.add_argument("--batch-schedule", action="store_true",
                        help="vllm: add num_speculative_tokens_per_batch_size, the draft length per batch size that "
                             "maximises goodput, from step costs timed now on this machine (random weights of the "
                             "model's shape; it must be the hardware the strategy was tuned on)")
    for action in (ls, show, delete, export):
        action.add_argument(
            "--storage", help="SQLAlchemy URL of the store (default: $AUTOTUNE_STORAGE or a local SQLite file)"
        )
        action.add_argument("--json", action="store_true", help="machine-readable output (one JSON line)")


def run(args: argparse.Namespace) -> int:
    from autotune.store.storage import open_storage

    with open_storage(args.storage) as storage:
        return ACTIONS[args.strategies_command](storage, args)


# ---------------------------------------------------------------------- actions
def _list(storage: Any, args: argparse.Namespace) -> int:
    rows = storage.list_best(**({"task": args.task} if args.task else {}))
    if args.model:
        rows = [r for r in rows if args.model in (r.key.model_id, r.key.model_id.split("@")[0])]
    if args.json:
        print(json.dumps([_row_dict(r) for r in rows]))
        return 0
    if not rows:
        print(f"no tuned strategies stored in {storage.display_url}", file=sys.stderr)
        return 0
    header = ("id", "model", "draft", "task", "strategy", "score", "tok/s", "predicted", "alpha", "updated")
    table = [header] + [
        (str(r.id), r.key.model_id, r.key.draft_id or "-", r.key.task, _summary(r), f"{r.score:.2f}",
         _num(r.measured_tps), _num(r.predicted_tps), _num(r.acceptance), r.updated_at.strftime("%Y-%m-%d %H:%M"))
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return 0


def _show(storage: Any, args: argparse.Namespace) -> int:
    stored = _require(storage, args.id)
    d = _row_dict(stored)
    d["history_count"] = len(storage.history(stored.key))
    if args.json:
        print(json.dumps(d))
        return 0
    strategy = d.pop("strategy")
    for name, value in d.items():
        if isinstance(value, dict):
            for sub_name, sub_value in value.items():
                print(f"{sub_name}: {sub_value}")
        else:
            print(f"{name}: {'-' if value is None else value}")
    print("strategy: " + json.dumps(strategy, indent=2, sort_keys=True))
    return 0


def _delete(storage: Any, args: argparse.Namespace) -> int:
    stored = _require(storage, args.id)
    if not storage.delete(stored.id):
        raise StorageError(f"stored strategy {args.id} was deleted meanwhile by another process")
    if args.json:
        print(json.dumps({"deleted": stored.id}))
    else:
        print(f"deleted strategy {stored.id}: {stored.key.describe()} (history kept)")
    return 0


def _export(storage: Any, args: argparse.Namespace) -> int:
    stored = _require(storage, args.id)
    payload, notes = export_strategy(stored, args.format)
    if args.batch_schedule:
        if args.format != "vllm" or not isinstance(payload, dict):
            raise CliError("--batch-schedule applies to --format vllm of a speculative strategy")
        from autotune.measure.steps import vllm_batch_schedule

        payload["num_speculative_tokens_per_batch_size"] = vllm_batch_schedule(stored)
        notes.append("num_speculative_tokens_per_batch_size was measured on this machine and transfers only to this "
                     "hardware")
    text = json.dumps(payload, sort_keys=True) if args.json else json.dumps(payload, indent=2, sort_keys=True)
    for note in notes:
        print(f"autotune: note: {note}", file=sys.stderr)
    if args.output is None:
        print(text)
    else:
        _write_atomic(args.output, text + "\n")
    return 0


ACTIONS: dict[str, Callable[[Any, argparse.Namespace], int]] = {
    "list": _list, "show": _show, "delete": _delete, "export": _export,
}


def _require(storage: Any, best_id: int) -> Any:
    stored = storage.get(best_id)
    if stored is None:
        raise StorageError(
            f"no stored strategy with id {best_id} in {storage.display_url}; `autotune strategies list` shows the ids"
        )
    return stored


def _row_dict(stored: Any) -> dict[str, Any]:
    from search_spaces.errors import StrategyError

    try:
        return stored.to_dict()
    except StrategyError as exc:  # written by a newer version: still list it
        return {"id": stored.id, "key": stored.key.as_row(), "strategy": None, "unreadable": str(exc)}


def _summary(stored: Any) -> str:
    from search_spaces.errors import StrategyError

    try:
        s = stored.strategy
    except StrategyError:
        return "(unreadable)"
    if not s.speculates:
        return "plain"
    parts = [s.drafter, f"k={s.draft_length}"]
    if s.tree_widths:
        parts.append("tree=" + ",".join(map(str, s.tree_widths)))
    if s.dynamic_widths:
        parts.append("dynamic")
    if s.layer_plan is not None:
        plan = s.layer_plan
        parts.append(f"plan({len(plan.groups)}g,{len(plan.skip_attn) + len(plan.skip_mlp)}skip)")
    return " ".join(parts)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
