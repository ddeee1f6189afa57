"""``autotune loadtest``: closed-loop clients against one or more running ``autotune serve``
servers, at several concurrencies and modes, and against peers it starts itself (``--peer
llama-server:...``) -> a table, JSON and a PNG of throughput and latency against concurrency. The
client is :mod:`autotune.measure.loadtest`, the peer :mod:`autotune.measure.llama_server`."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from autotune.cli.args import field_default
from autotune.cli.replay import STREAM_HELP, add_multi_turn_args, stream_config, stream_from_args
from autotune.errors import CliError
from autotune.measure.replay import CHOSEN, ReplaySettings, parse_modes
from autotune.serving.server import MAX_BATCH


def add_parser(sub: Any) -> None:
    p = sub.add_parser("loadtest", help="closed-loop clients against `autotune serve`: aggregate tok/s and latency "
                                        "at each concurrency and mode, with a plot")
    p.add_argument("--url", action="append", default=[], metavar="[LABEL=]URL",
                   help="a server to measure; repeat to compare servers in one run (e.g. new=http://...:8000 "
                        "old=http://...:8001)")
    p.add_argument("--stream", default="mixed", help=f"{STREAM_HELP} (default %(default)s)")
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
                        "(default %(default)s; 0: none): a fresh server's first requests run slower. They are the "
                        "unmeasured requests whose prompts open least like a measured one, so no server finds a "
                        "measured prompt's prefix cached by its warm-up")
    p.add_argument("--mode", default="plain,default,auto", help="comma list of auto, plain, default or stored "
                   "strategy ids (default %(default)s)")
    p.add_argument("--compare", metavar="MODE",
                   help="set MODE against the best other mode at each concurrency, and with --peer against the "
                        "best peer configuration: pooled ratio, each round's ratio and a 95%% interval over the "
                        "rounds (default: auto, when measured)")
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
    add_multi_turn_args(p)
    _add_peer_args(p)
    p.set_defaults(tasks=None, block=None, blocks_per_task=None, offset=None, seed=None)  # the mixed stream's defaults


def _add_peer_args(p: argparse.ArgumentParser) -> None:
    peer = p.add_argument_group("peers (llama.cpp's llama-server, built by `make peers`)")
    peer.add_argument("--peer", metavar="llama-server[:CONFIG,...]",
                      help="also start llama-server on the same GGUF files, one configuration at a time (plain, "
                           "ngram-simple, spec-default, draft-simple; default: all), measure each as a server of its "
                           "own (llama-server:CONFIG, plain OpenAI requests) and stop it; --compare then also sets "
                           "MODE against the best configuration at each concurrency")
    peer.add_argument("--peer-model", metavar="ALIAS",
                      help="the packaged GGUF model llama-server serves (default: `autotune study`'s default target, "
                           "the packaged Qwen2.5-Coder); it must be the model the --url servers serve")
    peer.add_argument("--peer-draft", metavar="ALIAS",
                      help="draft-simple's packaged GGUF draft (default: `autotune study`'s default draft)")
    peer.add_argument("--peer-threads", type=int, metavar="N",
                      help="llama-server's threads (default: torch's thread count, what our serve decodes with)")
    peer.add_argument("--peer-slots", type=int, default=MAX_BATCH, metavar="N",
                      help="llama-server's slots, -np (default %(default)s: serve's --max-batch where memory allows)")
    peer.add_argument("--peer-context", type=int, metavar="TOKENS",
                      help="prompt + completion tokens one request may hold, as serve's --max-context; llama-server "
                           "gets -c slots x this (default: what fits the slots in the memory free, at most the "
                           "model's context, as serve sizes it)")


def _peer_settings(args: argparse.Namespace) -> Any:
    """The peer's settings from the flags given (the others keep ``PeerSettings``' defaults), or None."""
    if args.peer is None:
        return None
    from autotune.measure.llama_server import PeerSettings, parse_peer

    given = {"model": args.peer_model, "draft": args.peer_draft, "threads": args.peer_threads,
             "request_context": args.peer_context}
    return PeerSettings(slots=args.peer_slots, configs=parse_peer(args.peer),
                        **{k: v for k, v in given.items() if v is not None})


def _check_same_model(servers: list[tuple[str, str]], peer: Any, timeout_s: float) -> None:
    """Each --url server serves the peer's model (else the comparison compares models)."""
    from autotune.measure.replay import ReplayClient

    for label, url in servers:
        with ReplayClient(ReplaySettings(url=url, timeout_s=timeout_s)) as client:
            served = client.model_name()
        if served != peer.model:
            raise CliError(f"--url {label} serves {served!r} but the peer would serve {peer.model!r}; "
                           f"pass --peer-model {served} (a packaged GGUF alias)")


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
    peer = _peer_settings(args)
    if not servers and peer is None:
        raise CliError("nothing to measure: pass --url [LABEL=]URL (a running `autotune serve`) and/or --peer")
    levels, modes = _levels(args.concurrency), parse_modes(args.mode)
    if CHOSEN in modes:
        raise CliError(f"--mode {CHOSEN} applies to `autotune replay` (auto's choice, forced, request by request)")
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
    peer_servers: list[Any] = []
    peer_plan = None
    if peer is not None:
        from autotune.measure.llama_server import peer_servers as make_peer_servers, plan, terminate_on_sigterm

        _check_same_model(servers, peer, args.timeout)
        peer_plan = plan(peer)  # built, GGUF files there, KV caches fit: before anything runs
        peer_servers = make_peer_servers(peer_plan)
        terminate_on_sigterm()  # a SIGTERM stops the running llama-server as Ctrl-C does
    points = load_test(servers, requests, modes, levels, args.max_tokens, args.timeout, progress,
                       args.requests_per_client, args.min_requests, args.rounds, args.warmup, peer_servers)
    print(format_points(earlier + points))
    comparisons = compare(points, compared)
    if comparisons:
        print()
        print(format_comparisons(comparisons))
    if args.json_out:
        args.json_out.write_text(json.dumps({"config": {"servers": servers, "stream": args.stream,
                                                        **stream_config(args), "requests": len(requests),
                                                        "max_tokens": args.max_tokens, "modes": list(modes),
                                                        "levels": levels, "rounds": args.rounds,
                                                        "warmup": args.warmup,
                                                        "peer": _describe(peer_plan)},
                                             "points": [p.as_dict() for p in points],
                                             "comparisons": [c.as_dict() for c in comparisons]}, indent=2))
    if args.plot:
        from autotune.reports.load_plots import load_plot

        print(f"plot: {load_plot(earlier + points, args.plot, comparisons)}")
    return 0


def _describe(peer_plan: Any) -> Any:
    if peer_plan is None:
        return None
    from autotune.measure.llama_server import describe

    return describe(peer_plan)
