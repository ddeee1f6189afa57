"""``autotune replay``: send a request stream to a running ``autotune serve`` in several modes,
print the per-category report and check the outputs agree (exit status 1 when any differ).

The client is :mod:`autotune.measure.replay`; the report :mod:`autotune.reports.replay_report`.
"""
from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path
from typing import Any

from autotune.cli.args import field_default
from autotune.errors import CliError
from autotune.measure.replay import ReplayClient, ReplayRecord, ReplaySettings, parse_modes, replay
from studies import stream
from studies.stream import StreamRequest


def add_parser(sub: Any) -> None:
    """Register ``replay`` on the top-level sub-parser action."""
    p = sub.add_parser("replay", help="send a request stream (e.g. the shifting `mixed` workload) to `autotune "
                                      "serve` in several modes; report speed per category and check outputs agree")
    p.add_argument("--stream", required=True, help="mixed (blocks of several tasks, shifting order) or a .jsonl file "
                                                   "of {category, messages | prompt} rows")
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="model name to request (default: the one the server lists)")
    p.add_argument("--mode", default=",".join(field_default(ReplaySettings, "modes")),
                   help="comma list of auto, plain, default or stored strategy ids; each request is sent in every "
                        "mode (default %(default)s)")
    p.add_argument("--concurrency", type=int, default=field_default(ReplaySettings, "concurrency"),
                   help="requests in flight at once (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=field_default(ReplaySettings, "max_tokens"),
                   help="completion tokens per request (default %(default)s)")
    p.add_argument("--limit", type=int, help="send only the stream's first N requests")
    p.add_argument("--timeout", type=float, default=field_default(ReplaySettings, "timeout_s"),
                   help="seconds to wait for one response (default %(default)s)")
    mixed = p.add_argument_group("the mixed stream")
    mixed.add_argument("--tasks", help=f"comma list of tasks (default {','.join(stream.DEFAULT_MIXED_TASKS)})")
    mixed.add_argument("--block", type=int, help=f"requests in a row from one task (default {stream.DEFAULT_BLOCK})")
    mixed.add_argument("--blocks-per-task", type=int,
                       help=f"blocks of each task = rounds of shifting order (default {stream.DEFAULT_BLOCKS_PER_TASK})")
    mixed.add_argument("--offset", type=int, help="first prompt of each task, to keep apart from the prompts a study "
                       f"tuned on (default {stream.DEFAULT_OFFSET})")
    mixed.add_argument("--seed", type=int, help=f"seed of the round orders (default {stream.DEFAULT_SEED})")
    p.add_argument("--json", dest="json_out", type=Path, help="write the report (and every record) to this file")
    p.add_argument("--plot", type=Path, metavar="FILE.png", help="draw tok/s per request over the stream")


def _stream_options(args: argparse.Namespace) -> dict[str, Any]:
    given = {"block": args.block, "blocks_per_task": args.blocks_per_task, "offset": args.offset, "seed": args.seed}
    options = {k: v for k, v in given.items() if v is not None}
    if args.tasks is not None:
        options["tasks"] = tuple(t.strip() for t in args.tasks.split(",") if t.strip())
    return options


def stream_from_args(args: argparse.Namespace) -> list[StreamRequest]:
    """The stream ``--stream`` names, cut to ``--limit``."""
    if args.limit is not None and args.limit < 1:
        raise CliError(f"--limit must be at least 1, got {args.limit}")
    requests = stream.load_stream(args.stream, **_stream_options(args))
    return requests[: args.limit] if args.limit is not None else requests


class Progress:
    """``replay 12/72`` on one refreshed stderr line while stderr is a terminal; silent otherwise."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.shown = total, 0, sys.stderr.isatty()
        self.lock = threading.Lock()

    def __call__(self, record: ReplayRecord) -> None:
        with self.lock:
            self.done += 1
            if self.shown:
                end = "\n" if self.done == self.total else ""
                print(f"\rreplay {self.done}/{self.total} ({record.category}, {record.mode})\033[K",
                      end=end, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    from autotune.reports.replay_report import aggregate, format_table, write_json

    settings = ReplaySettings(url=args.url, model=args.model, modes=parse_modes(args.mode),
                              concurrency=args.concurrency, max_tokens=args.max_tokens, timeout_s=args.timeout)
    requests = stream_from_args(args)
    with ReplayClient(settings) as client:
        model = client.model_name()
        progress = Progress(len(requests) * len(settings.modes))
        records = replay(requests, settings.modes, lambda r, m: client.chat(model, r, m), settings.concurrency,
                         progress)
        retunes, tasks = client.route_retunes(), client.stored_tasks()
    report = aggregate(records, settings.modes, retunes, tasks)
    report["config"] = {"stream": args.stream, "url": settings.url, "model": model, "modes": list(settings.modes),
                        "requests": len(requests), "max_tokens": settings.max_tokens,
                        "concurrency": settings.concurrency, **_stream_options(args)}
    print(format_table(report))
    if args.json_out:
        write_json(report, records, args.json_out)
    if args.plot:
        from autotune.reports.replay_report import replay_plot

        print(f"plot: {replay_plot(records, settings.modes, args.plot)}")
    return 1 if report["identical"]["differ"] else 0
