"""The ``autotune`` command line: the parser tree and the command registry. Each command is a module
of this package with ``add_parser(sub)`` and ``run(args)``; it only parses arguments and calls the library."""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn, Protocol

from autotune.cli import bench, diagnose, generate, loadtest, profile, replay, report, serve, strategies, study
from autotune.errors import USER_ERRORS


class Command(Protocol):
    """A command module: registers its sub-parser, runs on the parsed arguments (exit status)."""

    def add_parser(self, sub: Any) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


COMMANDS: dict[str, Command] = {  # in the order `autotune --help` lists them
    "generate": generate,
    "bench": bench,
    "strategies": strategies,
    "report": report,
    "replay": replay,
    "loadtest": loadtest,
    "profile": profile,
    "diagnose": diagnose,
    "study": study,
    "serve": serve,
}


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line (exit 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="autotune", description="Auto-tuned lossless speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for command in COMMANDS.values():
        command.add_parser(sub)
    return parser


def _quiet_libraries() -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _quiet_libraries()
        return COMMANDS[args.command].run(args)
    except USER_ERRORS as exc:
        print(f"autotune: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("autotune: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
