"""MkDocs hook: the CLI reference, generated from ``autotune``'s argparse tree at build time.

``docs/cli.md`` holds the marker below; ``on_page_markdown`` replaces it with one section per
command (its ``--help`` text), so the page follows the parser and nothing generated is committed.
``tests/test_docs.py`` builds the same text through :func:`cli_reference`."""
from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

MARKER = "<!-- cli-reference -->"
WIDTH = 100  # the help text's line width, fixed so the page does not follow the terminal


@contextmanager
def _columns(width: int) -> Iterator[None]:
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(width)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The parser's sub-parsers by name, in the order they were added (aliases left out)."""
    found: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            seen: set[int] = set()
            for name, sub in action.choices.items():  # an alias maps to a parser already listed
                if id(sub) not in seen:
                    seen.add(id(sub))
                    found[name] = sub
    return found


def _sections(parser: argparse.ArgumentParser, path: list[str], level: int) -> list[str]:
    out = []
    for name, sub in _subcommands(parser).items():
        words = [*path, name]
        out += [f"{'#' * level} `{' '.join(words)}`", "", "```text", sub.format_help().rstrip(), "```", ""]
        out += _sections(sub, words, level + 1)
    return out


def cli_reference() -> str:
    """Markdown: ``autotune --help``, then one section per command (and per sub-command)."""
    from autotune.cli.main import build_parser

    with _columns(WIDTH):
        parser = build_parser()
        lines = ["```text", parser.format_help().rstrip(), "```", ""]
        lines += _sections(parser, ["autotune"], 2)
    return "\n".join(lines)


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, cli_reference())
