"""``autotune replay``: send a request stream to a running ``autotune serve`` in several modes,
print the per-category report and check the outputs agree (exit status 1 when any differ).

The client is :mod:`autotune.measure.replay`; the report :mod:`autotune.reports.replay_report`.
"""
from __future__ import annotations

import argparse
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autotune.cli.args import field_default
from autotune.errors import CliError
from autotune.measure.replay import ReplayClient, ReplayRecord, ReplaySettings, parse_modes, replay
from studies import multi_turn, stream
from studies.stream import StreamRequest

STREAM_HELP = ("mixed (blocks of several tasks, shifting order), multi-turn (MT-Bench's second turns after a "
               "first-turn answer, generated once and cached) or a .jsonl file of {category, messages | prompt} rows")


def add_parser(sub: Any) -> None:
    """Register ``replay`` on the top-level sub-parser action."""
    p = sub.add_parser("replay", help="send a request stream (e.g. the shifting `mixed` workload) to `autotune "
                                      "serve` in several modes; report speed per category and check outputs agree")
    p.add_argument("--stream", required=True, help=STREAM_HELP)
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="model name to request (default: the one the server lists)")
    p.add_argument("--mode", default=",".join(field_default(ReplaySettings, "modes")),
                   help="comma list of auto, plain, default or stored strategy ids; each request is sent in every "
                        "mode (default %(default)s). chosen, after auto: the strategy auto started the request on, "
                        "forced (what auto costs beside it)")
    p.add_argument("--concurrency", type=int, default=field_default(ReplaySettings, "concurrency"),
                   help="requests in flight at once (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=field_default(ReplaySettings, "max_tokens"),
                   help="completion tokens per request (default %(default)s)")
    p.add_argument("--cache-prompt", action="store_true",
                   help="let requests reuse the server's prefix cache (off: a mode sent after another would find "
                        "its prompt cached and look faster; on, to measure the cache, e.g. --stream multi-turn)")
    p.add_argument("--repeat", type=int, default=field_default(ReplaySettings, "repeat"),
                   help="rounds of each request's modes, the order reversed every second round; each mode counts at "
                        "its median over them, and the report shows the spread between a mode's first two rounds "
                        "(default %(default)s)")
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
    add_multi_turn_args(p)
    p.add_argument("--json", dest="json_out", type=Path, help="write the report (and every record) to this file")
    p.add_argument("--plot", type=Path, metavar="FILE.png", help="draw tok/s per request over the stream")


def add_multi_turn_args(p: Any) -> None:
    """The ``multi-turn`` stream's flags (``replay`` and ``loadtest``)."""
    from autotune.measure.first_turns import AnswerSettings

    group = p.add_argument_group("the multi-turn stream")
    group.add_argument("--questions", type=int, help="MT-Bench questions, taken from each category in turn "
                       f"(default {multi_turn.DEFAULT_QUESTIONS})")
    group.add_argument("--answer-model", help="the model that writes the first-turn answers, once (default "
                       f"{field_default(AnswerSettings, 'model')}); cached in ~/.cache/autotune/streams "
                       "($AUTOTUNE_CACHE_DIR)")
    group.add_argument("--answer-precision", help="its precision (default "
                       f"{field_default(AnswerSettings, 'precision')}, as autotune serve)")
    group.add_argument("--answer-tokens", type=int, help="a first-turn answer's tokens at most (default "
                       f"{field_default(AnswerSettings, 'max_tokens')})")


def _mixed_options(args: argparse.Namespace) -> dict[str, Any]:
    given = {"block": args.block, "blocks_per_task": args.blocks_per_task, "offset": args.offset, "seed": args.seed}
    options = {k: v for k, v in given.items() if v is not None}
    if args.tasks is not None:
        options["tasks"] = tuple(t.strip() for t in args.tasks.split(",") if t.strip())
    return options


def _multi_turn_options(args: argparse.Namespace) -> dict[str, Any]:
    from autotune.measure.first_turns import AnswerSettings, PlainAnswerer
    from runtime.machine import cache_root

    given = {"model": args.answer_model, "precision": args.answer_precision, "max_tokens": args.answer_tokens}
    settings = AnswerSettings(**{k: v for k, v in given.items() if v is not None})
    options: dict[str, Any] = {"answerer": PlainAnswerer(settings), "cache_dir": cache_root()}
    if args.questions is not None:
        options["questions"] = args.questions
    return options


STREAM_OPTIONS: dict[str, tuple[tuple[str, ...], Callable[[argparse.Namespace], dict[str, Any]]]] = {
    "mixed": (("tasks", "block", "blocks_per_task", "offset", "seed"), _mixed_options),
    "multi-turn": (("questions", "answer_model", "answer_precision", "answer_tokens"), _multi_turn_options),
}
"""Each named stream (``studies.stream.STREAMS``): its flags, and its options built from them."""


def _given(args: argparse.Namespace, flags: tuple[str, ...]) -> dict[str, Any]:
    return {flag: getattr(args, flag) for flag in flags if getattr(args, flag, None) is not None}


def _stream_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options of the stream ``--stream`` names; a flag of another named stream is an error (a
    file's stream: every flag given is passed on, for ``load_stream`` to refuse)."""
    if args.stream not in STREAM_OPTIONS:
        return {k: v for flags, _ in STREAM_OPTIONS.values() for k, v in _given(args, flags).items()}
    for name, (flags, _) in STREAM_OPTIONS.items():
        misplaced = list(_given(args, flags)) if name != args.stream else []
        if misplaced:
            flag = "--" + misplaced[0].replace("_", "-")
            raise CliError(f"{flag} applies to --stream {name}, not {args.stream}; drop it or change --stream")
    return STREAM_OPTIONS[args.stream][1](args)


def stream_config(args: argparse.Namespace) -> dict[str, Any]:
    """The stream flags given, for a report's config."""
    given = _given(args, STREAM_OPTIONS[args.stream][0]) if args.stream in STREAM_OPTIONS else {}
    if "tasks" in given:
        given["tasks"] = list(_mixed_options(args)["tasks"])
    return given


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
                              concurrency=args.concurrency, max_tokens=args.max_tokens, timeout_s=args.timeout,
                              cache_prompt=args.cache_prompt, repeat=args.repeat)
    requests = stream_from_args(args)
    with ReplayClient(settings) as client:
        model = client.model_name()
        progress = Progress(len(requests) * len(settings.modes) * settings.repeat)
        records = replay(requests, settings.modes, lambda r, m: client.chat(model, r, m), settings.concurrency,
                         progress, settings.repeat)
        retunes, tasks = client.route_retunes(), client.stored_tasks()
    report = aggregate(records, settings.modes, retunes, tasks)
    report["config"] = {"stream": args.stream, "url": settings.url, "model": model, "modes": list(settings.modes),
                        "requests": len(requests), "max_tokens": settings.max_tokens,
                        "concurrency": settings.concurrency, "cache_prompt": settings.cache_prompt,
                        "repeat": settings.repeat,
                        **stream_config(args)}
    print(format_table(report))
    if args.json_out:
        write_json(report, records, args.json_out)
    if args.plot:
        from autotune.reports.replay_report import replay_plot

        print(f"plot: {replay_plot(records, settings.modes, args.plot)}")
    return 1 if report["identical"]["differ"] else 0
