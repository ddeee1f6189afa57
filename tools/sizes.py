"""Module and class sizes of the library packages against the house limits (500 lines a module,
300 a class): `python tools/sizes.py` lists the largest five of each and exits 1 past a limit."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("autotune", "runtime", "search_spaces", "studies")
MODULE_LIMIT, CLASS_LIMIT = 500, 300


def sizes(root: Path = ROOT) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(lines, module path) and (lines, module:Class) of every library module and class, largest first."""
    modules, classes = [], []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            rel = str(path.relative_to(root))
            modules.append((len(text.splitlines()), rel))
            for node in ast.walk(ast.parse(text, filename=rel)):
                if isinstance(node, ast.ClassDef):
                    classes.append((node.end_lineno - node.lineno + 1, f"{rel}:{node.name}"))
    return sorted(modules, reverse=True), sorted(classes, reverse=True)


def over(root: Path = ROOT) -> list[str]:
    """Every module or class past its limit."""
    modules, classes = sizes(root)
    return ([f"{name} {n} lines > {MODULE_LIMIT}" for n, name in modules if n > MODULE_LIMIT]
            + [f"{name} {n} lines > {CLASS_LIMIT}" for n, name in classes if n > CLASS_LIMIT])


def main() -> int:
    modules, classes = sizes()
    for title, rows, limit in (("modules", modules, MODULE_LIMIT), ("classes", classes, CLASS_LIMIT)):
        print(f"largest {title} (limit {limit} lines):")
        for n, name in rows[:5]:
            print(f"  {n:4d}  {name}")
    bad = over()
    for line in bad:
        print(f"over: {line}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
