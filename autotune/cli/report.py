"""``autotune report [STUDY] --out DIR``: the plots of one study, or of every study in the store.

One study: its PNGs and ``index.html`` go into DIR. No STUDY: one sub-directory per study (a safe
name: study names hold ``|``, ``+``, ``@`` and ``:``) and a top-level ``index.html`` linking them.
An empty store or an unknown study name fails before anything is written.
"""
from __future__ import annotations

import argparse
import hashlib
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from autotune.errors import CliError


def add_report_parser(sub: Any) -> None:
    """Register ``report`` on the top-level sub-parser action."""
    p = sub.add_parser("report", help="plot a study (or every study in the store) as PNGs and an index.html")
    p.add_argument("study", nargs="?", help="study name (as `autotune study` prints it); default: every study")
    p.add_argument("--storage", help="SQLAlchemy URL of the store (default: $AUTOTUNE_STORAGE or a local SQLite file)")
    p.add_argument("--out", required=True, type=Path, help="directory to write the report into (created)")


def cmd_report(args: argparse.Namespace) -> int:
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


def study_names(optuna_storage: Any, shown_url: str) -> list[str]:
    """The store's study names, sorted; none is a user error."""
    import optuna

    names = sorted(optuna.get_all_study_names(storage=optuna_storage))
    if not names:
        raise CliError(f"no studies in {shown_url}; run `autotune study` first (or pass --storage)")
    return names


def plot_loaded(optuna_storage: Any, name: str, out_dir: Path) -> Path:
    import optuna

    from autotune.reports.plots import write_study_report

    return write_study_report(optuna.load_study(study_name=name, storage=optuna_storage), out_dir)


def plot_study(storage_url: str | None, name: str, out_dir: Path) -> Path:
    """Open the store at ``storage_url`` and write study ``name``'s report into ``out_dir``."""
    from autotune.store.storage import open_storage

    with open_storage(storage_url) as storage:
        return plot_loaded(storage.optuna_storage(), name, out_dir)


def write_all(optuna_storage: Any, names: Sequence[str], out_dir: Path) -> Path:
    """One sub-directory per study and an index linking them; returns the top index's path."""
    import optuna

    from autotune.reports.plots import INDEX, index_page

    dirs = safe_dir_names(names)
    summaries = {s.study_name: s for s in optuna.get_all_study_summaries(storage=optuna_storage)}
    links = []
    for name in names:
        plot_loaded(optuna_storage, name, out_dir / dirs[name])
        n = summaries[name].n_trials if name in summaries else 0
        links.append((f"{dirs[name]}/{INDEX}", name, f"({n} trials)"))
    index = out_dir / INDEX
    index.write_text(index_page("autotune studies", links), encoding="utf-8")
    return index


def safe_dir_names(names: Sequence[str]) -> dict[str, str]:
    """A directory name per study name: runs of characters outside ``[A-Za-z0-9._-]`` become ``_``;
    names that would collide (or come out empty) get a short hash of the full name appended."""
    base = {n: re.sub(r"[^A-Za-z0-9._-]+", "_", n).strip("._") for n in names}
    counts: dict[str, int] = {}
    for b in base.values():
        counts[b] = counts.get(b, 0) + 1
    return {
        n: b if b and counts[b] == 1 else f"{b or 'study'}-{hashlib.sha1(n.encode()).hexdigest()[:8]}"
        for n, b in base.items()
    }
