"""``autotune report [STUDY] --out DIR``: the plots of one study, or of every study in the store.

One study: its PNGs and ``index.html`` go into DIR. No STUDY: one sub-directory per study and a
top-level ``index.html`` linking them (:mod:`autotune.reports.study_report`). An empty store or an
unknown study name fails before anything is written.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from autotune.errors import CliError


def add_parser(sub: Any) -> None:
    """Register ``report`` on the top-level sub-parser action."""
    p = sub.add_parser("report", help="plot a study (or every study in the store) as PNGs and an index.html")
    p.add_argument("study", nargs="?", help="study name (as `autotune study` prints it); default: every study")
    p.add_argument("--storage", help="SQLAlchemy URL of the store (default: $AUTOTUNE_STORAGE or a local SQLite file)")
    p.add_argument("--out", required=True, type=Path, help="directory to write the report into (created)")


def run(args: argparse.Namespace) -> int:
    from autotune.reports.study_report import plot_loaded, study_names, write_all
    from autotune.store.storage import open_storage

    with open_storage(args.storage) as storage:
        optuna_storage = storage.optuna_storage()
        names = study_names(optuna_storage, storage.display_url)
        if args.study is not None:
            if args.study not in names:
                raise CliError(f"no study named {args.study!r} in {storage.display_url}; studies there: "
                               + ", ".join(repr(n) for n in names))
            index = plot_loaded(optuna_storage, args.study, args.out)
        else:
            index = write_all(optuna_storage, names, args.out)
    print(f"plots: {index}")
    return 0
