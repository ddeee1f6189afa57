"""Only ``autotune.cli`` names ``CliError``: every other module of ``autotune`` raises the
``AutotuneError`` subclass named for what went wrong (``autotune/errors.py``), so a library error
reads the same whether the CLI, the server or a script called the library."""
from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NAME = "CliError"
ALLOWED = ("autotune/cli",)  # where ``CliError`` may be imported and raised
DEFINED_IN = "autotune/errors.py"  # where it is defined (a class statement, not a use)


def cli_error_uses(path: Path) -> list[int]:
    """Lines of ``path`` that import, raise, catch or otherwise name ``CliError`` (lazy imports and
    ``errors.CliError`` included)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and any(a.name == NAME for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.Name) and node.id == NAME:
            lines.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr == NAME:
            lines.append(node.lineno)
    return sorted(set(lines))


def library_violations(root: Path = ROOT, allowed: Iterable[str] = ALLOWED) -> list[str]:
    """``path:line`` of every use of ``CliError`` in ``root/autotune`` outside the ``allowed`` folders."""
    allowed = tuple(allowed)
    bad = []
    for path in sorted((root / "autotune").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if any(rel == a or rel.startswith(a + "/") for a in allowed):
            continue
        bad.extend(f"{rel}:{line}" for line in cli_error_uses(path))
    return bad


def test_only_the_cli_names_cli_error() -> None:
    assert library_violations() == []


def test_the_scan_sees_the_cli_and_the_definition() -> None:
    """The scan reads the real tree: the CLI's own uses are found (a scan that found nothing
    anywhere would pass everything), and the class statement is not a use."""
    assert cli_error_uses(ROOT / "autotune/cli/args.py")
    assert (ROOT / DEFINED_IN).is_file() and cli_error_uses(ROOT / DEFINED_IN) == []


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in {"autotune/__init__.py": "", "autotune/cli/__init__.py": "", **files}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@pytest.mark.parametrize("text", [
    "from autotune.errors import CliError\n",
    "def f():\n    raise CliError('x')\n",
    "import autotune.errors as e\n\ndef f():\n    raise e.CliError('x')\n",
    "def f():\n    from autotune.errors import SettingError, CliError\n",
    "try:\n    pass\nexcept CliError:\n    pass\n",
])
def test_a_library_use_of_cli_error_is_found(tmp_path: Path, text: str) -> None:
    """Power check: an import (even lazy), a raise (even through the module) or a catch of
    ``CliError`` in a library module is reported; the same text inside ``autotune/cli`` is not."""
    root = _tree(tmp_path, {"autotune/measure/x.py": text, "autotune/cli/x.py": text})
    found = library_violations(root)
    assert found and all(v.startswith("autotune/measure/x.py:") for v in found)


def test_a_clean_library_module_passes(tmp_path: Path) -> None:
    """Power check the other way: library errors, and ``CliError`` only in a docstring, are fine."""
    root = _tree(tmp_path, {"autotune/measure/x.py": (
        '"""Raises SettingError, never CliError."""\nfrom autotune.errors import SettingError\n\n'
        "def f():\n    raise SettingError('x')\n"
    ), "autotune/errors.py": "class CliError(ValueError):\n    pass\n"})
    assert library_violations(root) == []
