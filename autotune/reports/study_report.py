"""The plots of the studies in a store: one study's report directory, or every study's under one
directory with a top-level ``index.html`` linking them (a safe directory name per study: study
names hold ``|``, ``+``, ``@`` and ``:``). Everything here reads an Optuna storage; opening the
store is the caller's job."""
from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from autotune.errors import StorageError


def study_names(optuna_storage: Any, shown_url: str) -> list[str]:
    """The store's study names, sorted; none is a user error."""
    import optuna

    names = sorted(optuna.get_all_study_names(storage=optuna_storage))
    if not names:
        raise StorageError(f"no studies in {shown_url}; run `autotune study` first (or pass --storage)")
    return names


def plot_loaded(optuna_storage: Any, name: str, out_dir: Path) -> Path:
    """Write study ``name``'s plots and ``index.html`` into ``out_dir``; returns the index's path."""
    import optuna

    from autotune.reports.plots import write_study_report

    return write_study_report(optuna.load_study(study_name=name, storage=optuna_storage), out_dir)


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
