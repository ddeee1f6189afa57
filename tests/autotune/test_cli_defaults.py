"""A flag whose default is a setting's reads it from the dataclass field (``field_default``), and help
shows a default with ``%(default)s``, never a copied literal: the two cannot drift."""
from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from autotune.cli.args import field_default, int_list
from autotune.cli.main import build_parser
from autotune.measure.bench import BenchContext
from autotune.measure.profile_settings import ProfileSettings
from autotune.measure.replay import ReplaySettings
from autotune.serving.adaptive.settings import AdaptSettings
from autotune.serving.limits import Limits
from autotune.serving.server import ServeConfig
from autotune.tuning.tuner_state import TunerSettings
from runtime.decoding import GenerationConfig
from runtime.sampling import SamplingParams
from search_spaces.spaces import SpaceContext


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int_list("flag", text))


def _modes(text: str) -> tuple[str, ...]:
    return tuple(text.split(","))


# (command, flag's dest, dataclass, field, how the flag's text reads as the field's value)
CASES: list[tuple[str, str, type, str, Callable[[Any], Any] | None]] = [
    *[("study", dest, TunerSettings, name, None) for dest, name in (
        ("trials", "max_trials"), ("patience", "patience"), ("window", "window"), ("beta", "beta"),
        ("stop_matchness", "match_threshold"), ("max_share", "max_share"), ("seed", "seed"))],
    ("study", "skip_ratio", SpaceContext, "skip_ratio", None),
    *[("serve", dest, ServeConfig, name, None) for dest, name in (
        ("host", "host"), ("port", "port"), ("max_queue", "max_queue"), ("grace", "grace_s"))],
    ("serve", "max_body_bytes", Limits, "max_body_bytes", None),
    ("serve", "request_timeout", Limits, "request_timeout_s", None),
    *[("serve", name, AdaptSettings, name, None) for name in (
        "acceptance_drop", "retune_requests", "retune_share", "new_route_requests", "max_routes",
        "recheck_plain_requests")],
    ("replay", "mode", ReplaySettings, "modes", _modes),
    ("replay", "concurrency", ReplaySettings, "concurrency", None),
    ("replay", "max_tokens", ReplaySettings, "max_tokens", None),
    ("replay", "timeout", ReplaySettings, "timeout_s", None),
    ("loadtest", "max_tokens", ReplaySettings, "max_tokens", None),
    ("loadtest", "timeout", ReplaySettings, "timeout_s", None),
    ("profile", "widths", ProfileSettings, "widths", _ints),
    ("profile", "lp_size", ProfileSettings, "lp_sizes", _ints),
    ("profile", "min_time", ProfileSettings, "min_run_time", None),
    ("bench", "lp_size", BenchContext, "lp_size", None),
    ("bench", "skip_ratio", BenchContext, "skip_ratio", None),
    *[("generate", name, SamplingParams, name, None) for name in ("temperature", "top_p", "top_k")],
    ("generate", "seed", GenerationConfig, "seed", None),
]


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def drifted(commands: dict[str, argparse.ArgumentParser], cases: list[tuple]) -> list[str]:
    """``command --flag`` of each case whose parser default is not the field's default (or that
    has no such flag)."""
    bad = []
    for command, dest, cls, name, read in cases:
        actions = {a.dest: a for a in commands[command]._actions}
        if dest not in actions:
            bad.append(f"{command} {dest}: no such flag")
            continue
        default = actions[dest].default
        value = read(default) if read and default is not None else default
        if value != field_default(cls, name):
            bad.append(f"{command} {dest}: parser default {default!r}, {cls.__name__}.{name} "
                       f"{field_default(cls, name)!r}")
    return bad


def _all_actions(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.Action]]:
    for command, sub in subparsers(parser).items():
        for action in sub._actions:
            yield command, action


def copied_defaults(parser: argparse.ArgumentParser) -> list[str]:
    """Flags whose raw help spells out their own default, a number or a list of numbers (``default
    96``), instead of ``%(default)s``."""
    bad = []
    for command, action in _all_actions(parser):
        default = action.default
        numeric = isinstance(default, (int, float)) and not isinstance(default, bool)
        if not action.help or not (numeric or isinstance(default, str) and re.fullmatch(r"[\d.,]+", default)):
            continue
        shown = {str(default), f"{default:g}"} if isinstance(default, (int, float)) else {default}
        for literal in shown:
            if re.search(rf"default:? {re.escape(literal)}(?![\w.])", action.help):
                bad.append(f"{command} {action.dest}: help says 'default {literal}'")
    return bad


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    return build_parser()


def test_flag_defaults_are_the_fields_defaults(parser: argparse.ArgumentParser) -> None:
    assert drifted(subparsers(parser), CASES) == []


def test_help_shows_defaults_from_the_parser(parser: argparse.ArgumentParser) -> None:
    assert copied_defaults(parser) == []
    shown = subparsers(parser)["study"].format_help()
    assert f"default {field_default(TunerSettings, 'max_trials')}" in " ".join(shown.split())


def _toy() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    study = sub.add_parser("study")
    study.add_argument("--window", type=int, default=33, help="tokens scored (default 33)")
    study.add_argument("--beta", type=int, default=field_default(TunerSettings, "beta"), help="(default %(default)s)")
    profile = sub.add_parser("profile")
    profile.add_argument("--widths", default="1,2", help="rows (default: 1,2)")
    return parser


def test_a_drifted_default_is_found() -> None:
    """Power check: a literal default that differs from the field's, a list that differs once
    read, and a case naming no flag are each reported; a default read from the field is not."""
    commands = subparsers(_toy())
    cases = [("study", "window", TunerSettings, "window", None), ("study", "beta", TunerSettings, "beta", None),
             ("profile", "widths", ProfileSettings, "widths", _ints),
             ("study", "patience", TunerSettings, "patience", None)]
    found = drifted(commands, cases)
    assert [f.split(":")[0] for f in found] == ["study window", "profile widths", "study patience"]


def test_a_copied_default_in_help_is_found() -> None:
    """Power check: help spelling out its flag's own default (a number or a list) is reported;
    ``%(default)s`` is not."""
    found = copied_defaults(_toy())
    assert found == ["study window: help says 'default 33'", "profile widths: help says 'default 1,2'"]
