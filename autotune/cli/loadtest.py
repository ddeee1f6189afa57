"""``autotune loadtest``: closed-loop clients against one or more running ``autotune serve``
servers, at several concurrencies and modes -> a table, JSON and a PNG of throughput and latency
against concurrency. The client is :mod:`autotune.measure.loadtest`."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from autotune.cli.args import field_default
from autotune.cli.replay import stream_from_args
from autotune.errors import CliError
from autotune.measure.replay import ReplaySettings, parse_modes


def add_parser(sub: Any) -> None:
    p = sub.add_parser("loadtest", help="closed-loop clients against `autotune serve`: aggregate tok/s and latency "
                                        "at each concurrency and mode, with a plot")
    p.add_argument("--url", action="append", required=True, metavar="[LABEL=]URL",
                   help="a server to measure; repeat to compare servers in one run (e.g. new=http://...:8000 "
                        "old=http://...:8001)")
    p.add_argument("--stream", default="mixed", help="mixed, or a .jsonl file of {category, messages | prompt} rows")
    p.add_argument("--limit", type=int, help="take only the stream's first N requests")
    p.add_argument("--requests-per-client", type=int, default=2, metavar="N",
                   help="each point sends N x its concurrency requests, the stream's first ones taken one "
                        "category at a time in turn (default %(default)s)")
    p.add_argument("--min-requests", type=int, default=8, metavar="N",
                   help="each point sends at least N requests (default %(default)s: the mixed stream's four "
                        "categories twice), so a point of few clients is not decided by one or two prompts")
    p.add_argument("--rounds", type=int, default=1, metavar="N",
                   help="measure every mode N times at each concurrency, the modes in turn and each round in a "
                        "rotated order, and pool a mode's rounds into its point (default %(default)s); the table shows "
                        "each round's tok/s, the point's noise")
    p.add_argument("--warmup", type=int, default=1, metavar="N",
                   help="before a server's first point, send N requests per mode from one client, not measured "
                        "(default %(default)s; 0: none): a fresh server's first requests run slower")
    p.add_argument("--mode", default="plain,default,auto", help="comma list of auto, plain, default or stored "
                   "strategy ids (default %(default)s)")
    p.add_argument("--compare", metavar="MODE",
                   help="set MODE against the best other mode at each concurrency: pooled ratio, each round's "
                        "ratio and a 95%% interval over the rounds (default: auto, when measured)")
    p.add_argument("--concurrency", default="1,4,16", help="comma list of client counts (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=field_default(ReplaySettings, "max_tokens"),
                   help="completion tokens per request (default %(default)s)")
    p.add_argument("--timeout", type=float, default=field_default(ReplaySettings, "timeout_s"),
                   help="seconds to wait for one response (default %(default)s)")
    p.add_argument("--json", dest="json_out", type=Path, help="write the points to this file")
    p.add_argument("--plot", type=Path, metavar="FILE.png", help="draw throughput and latency against concurrency")
    p.add_argument("--also", type=Path, action="append", default=[], metavar="FILE.json",
                   help="points of an earlier run (its --json) to show beside this run's (e.g. another server "
                        "measured alone, when two do not fit in memory at once)")
    p.set_defaults(tasks=None, block=None, blocks_per_task=None, offset=None, seed=None)  # the mixed stream's defaults


def _servers(urls: list[str]) -> list[tuple[str, str]]:
    servers = []
    for i, given in enumerate(urls):
        label, sep, url = given.partition("=")
        servers.append((label, url) if sep and not label.startswith("http") else (f"server{i + 1}", given))
    return servers


def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CliError(f"--concurrency must be a comma list of whole numbers, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise CliError(f"--concurrency levels must be at least 1, got {text!r}")
    return levels


def run(args: argparse.Namespace) -> int:
    from autotune.measure.loadtest import compare, format_comparisons, format_points, load_test, read_points

    servers = _servers(args.url)
    levels, modes = _levels(args.concurrency), parse_modes(args.mode)
    if args.compare is not None and args.compare not in modes:
        raise CliError(f"--compare {args.compare!r} is not among --mode {','.join(modes)}; name one of them")
    compared = args.compare or "auto"
    requests = stream_from_args(args)

    def progress(point: Any) -> None:
        print(f"{point.server} {point.mode} x{point.concurrency}: {point.tokens_per_s:.2f} tok/s, "
              f"p50 {point.latency_p50_s:.1f} s", file=sys.stderr, flush=True)

    earlier = [point for path in args.also for point in read_points(path)]
    if args.requests_per_client < 1:
        raise CliError(f"--requests-per-client must be at least 1, got {args.requests_per_client}")
    if args.min_requests < 1:
        raise CliError(f"--min-requests must be at least 1, got {args.min_requests}")
    if args.rounds < 1:
        raise CliError(f"--rounds must be at least 1, got {args.rounds}")
    if args.warmup < 0:
        raise CliError(f"--warmup must be 0 or more, got {args.warmup}")
    points = load_test(servers, requests, modes, levels, args.max_tokens, args.timeout, progress,
                       args.requests_per_client, args.min_requests, args.rounds, args.warmup)
    print(format_points(earlier + points))
    comparisons = compare(points, compared)
    if comparisons:
        print()
        print(format_comparisons(comparisons))
    if args.json_out:
        args.json_out.write_text(json.dumps({"config": {"servers": servers, "stream": args.stream, "requests": len(requests),
                                                        "max_tokens": args.max_tokens, "modes": list(modes),
                                                        "levels": levels, "rounds": args.rounds,
                                                        "warmup": args.warmup},
                                             "points": [p.as_dict() for p in points],
                                             "comparisons": [c.as_dict() for c in comparisons]}, indent=2))
    if args.plot:
        from autotune.reports.plots import load_plot

        print(f"plot: {load_plot(earlier + points, args.plot)}")
    return 0
