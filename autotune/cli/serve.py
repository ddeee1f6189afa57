"""``autotune serve``: the OpenAI-compatible server that routes each request to its task's strategy."""
from __future__ import annotations

import argparse
import os
from typing import Any

from autotune.cli.args import add_model_args, field_default
from autotune.errors import CliError
from autotune.serving.adaptive.settings import AdaptSettings as AdaptDefaults
from autotune.serving.limits import API_KEY_ENV, Limits
from autotune.serving.server import PREFILL_CHUNK, ServeConfig
from autotune.serving.sizing import MAX_BATCH, PREFIX_CACHE_GIB, PREFIX_SHARE
from runtime.decoding import GenerationConfig


def add_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible server that routes each request to its task's strategy")
    add_model_args(p)
    p.add_argument("--storage", help="strategy store URL (default: $AUTOTUNE_STORAGE or a local SQLite file)")
    p.add_argument("--host", default=field_default(ServeConfig, "host"))
    p.add_argument("--port", type=int, default=field_default(ServeConfig, "port"))
    p.add_argument("--max-queue", type=int, default=field_default(ServeConfig, "max_queue"),
                   help="requests waiting beyond this get 503 + Retry-After (default %(default)s)")
    p.add_argument("--max-batch", type=int, metavar="N",
                   help=f"requests decoded side by side (continuous batching; default: {MAX_BATCH}, or what memory "
                        "allows for --max-context where it is given; 1 decodes one request at a time)")
    p.add_argument("--max-batch-rows", type=int, metavar="ROWS",
                   help="target rows one decode step verifies at most (plain: 1 per request, speculative: 1 + "
                        "drafted); drafts shrink to fit (default: no limit)")
    p.add_argument("--prefill-chunk", type=int, metavar="TOKENS",
                   help="a longer prompt is prefilled in chunks of this many tokens, one per decode step: inside "
                        "the step's target forward, beside the running requests' rows, where the target's rows are "
                        "reusable (gguf, w8a8, oneDNN float32), else alone between steps (default: "
                        f"{PREFILL_CHUNK['cpu']} on the CPU, where a step runs ~25 ms a prompt row; elsewhere "
                        f"{field_default(GenerationConfig, 'prefill_chunk')}, as llama.cpp's n_ubatch)")
    p.add_argument("--max-context", type=int, metavar="TOKENS",
                   help="prompt + max_tokens of one request (default: what fits --max-batch requests in the memory "
                        "free after loading, beside the prefix cache, at most the model's context; the ready line "
                        "says what it chose); longer requests get a 400")
    p.add_argument("--prefix-cache-gib", type=float, metavar="GIB",
                   help="memory for K/V rows kept across requests: a prompt that starts like an earlier request "
                        "(a shared system prompt, a chat's earlier turns) skips their prefill, with the same output "
                        f"(default: {PREFIX_CACHE_GIB:g}, or {PREFIX_SHARE * 100:.0f}%% of the free memory where less; a request "
                        "opts out with \"cache_prompt\": false)")
    p.add_argument("--no-prefix-cache", dest="prefix_cache_gib", action="store_const", const=0.0,
                   help="keep no rows across requests")
    p.add_argument("--route-distance", type=float,
                   help="cosine distance beyond which a prompt is 'unknown' (default: the measured one)")
    p.add_argument("--grace", type=float, default=field_default(ServeConfig, "grace_s"), metavar="S",
                   help="on SIGTERM the waiting requests get 503 at once and the running one has S seconds "
                        "to finish before it is stopped; then the process exits 0 (default %(default)s)")
    p.add_argument("--no-request-control", dest="request_control", action="store_false",
                   help="routed requests keep their route's strategy to the end (default: each request switches, "
                        "between rounds, to what its own tokens show is fastest, and stops speculating where that "
                        "measured slower than plain decoding)")
    _add_limit_args(p)
    _add_adaptive_args(p)


def _add_limit_args(p: argparse.ArgumentParser) -> None:
    limits = p.add_argument_group("access and limits")
    limits.add_argument("--api-key", metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on /v1/* (/health and /metrics stay open; "
                             f"default: ${API_KEY_ENV}, else no key)")
    limits.add_argument("--max-body-bytes", type=int, default=field_default(Limits, "max_body_bytes"),
                        help="a larger request body gets 413 unread (default %(default)s)")
    limits.add_argument("--request-timeout", type=float, default=field_default(Limits, "request_timeout_s"),
                        metavar="S",
                        help="a request still waiting or decoding after S seconds gets 504 and is stopped "
                             "(default %(default)s)")


def _add_adaptive_args(p: argparse.ArgumentParser) -> None:
    adapt = p.add_argument_group("adaptive serving (drift detection, re-tuning on live traffic, new routes)")
    adapt.add_argument("--adaptive", action="store_true",
                       help="watch each route's acceptance and speed; fall back to plain and re-tune on drift")
    adapt.add_argument("--acceptance-drop", type=float, default=field_default(AdaptDefaults, "acceptance_drop"),
                       help="re-tune a route whose acceptance falls below (1 - this) x its stored acceptance "
                            "(default %(default)s)")
    adapt.add_argument("--retune-requests", type=int, default=field_default(AdaptDefaults, "retune_requests"),
                       help="requests a re-tune decodes with the online tuner (default %(default)s)")
    adapt.add_argument("--retune-share", type=float, default=field_default(AdaptDefaults, "retune_share"),
                       help="cap on a re-tune's tuning time, as a share of its decode time (default %(default)s)")
    adapt.add_argument("--new-route-requests", type=int, default=field_default(AdaptDefaults, "new_route_requests"),
                       help="unknown requests of one topic (a pending cluster) that become a new route "
                            "(default %(default)s)")
    adapt.add_argument("--max-routes", type=int, default=field_default(AdaptDefaults, "max_routes"),
                       help="routes created from unknown traffic, at most (per model, draft and hardware; "
                            "default %(default)s)")
    adapt.add_argument("--store-prompts", action="store_true",
                       help="store the text of the requests a route was re-tuned or created on (default: only "
                            "their hashed word counts, enough to route by, not to read)")
    adapt.add_argument("--recheck-plain-requests", type=int,
                       default=field_default(AdaptDefaults, "recheck_plain_requests"),
                       help="requests a route stored as plain serves before it re-checks whether speculation "
                            "pays (default %(default)s)")


def run(args: argparse.Namespace) -> int:
    from autotune.serving.server import ServeConfig, serve

    if args.store_prompts and not args.adaptive:
        raise CliError("--store-prompts applies to adaptive serving (what a re-tune stores); add --adaptive")
    adaptive = AdaptDefaults(
        acceptance_drop=args.acceptance_drop, retune_requests=args.retune_requests, retune_share=args.retune_share,
        new_route_requests=args.new_route_requests, recheck_plain_requests=args.recheck_plain_requests,
        max_routes=args.max_routes, store_prompts=args.store_prompts,
    ) if args.adaptive else None
    return serve(ServeConfig(
        model=args.model, draft=args.draft, dtype=args.precision, device=args.device, compile=args.compile,
        storage=args.storage, host=args.host, port=args.port, max_queue=args.max_queue, route_distance=args.route_distance,
        adaptive=adaptive, grace_s=args.grace, max_batch=args.max_batch, max_context=args.max_context,
        prefix_cache_gib=args.prefix_cache_gib,
        max_batch_rows=args.max_batch_rows, prefill_chunk=args.prefill_chunk, request_control=args.request_control,
        limits=Limits(
            api_key=args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None,
            max_body_bytes=args.max_body_bytes, request_timeout_s=args.request_timeout),
    ))
