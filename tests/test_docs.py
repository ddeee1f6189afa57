"""The documentation's checks that need no MkDocs: the CLI reference the site's hook generates covers
every command, the README stays a short front door whose relative links resolve, and every page
under docs/ is in the site's nav (``make docs`` runs the full ``mkdocs build --strict``)."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

from autotune.cli.main import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _hook() -> ModuleType:
    path = DOCS / "hooks" / "cli_reference.py"
    spec = importlib.util.spec_from_file_location("cli_reference_hook", path)
    assert spec and spec.loader, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_reference_has_every_command():
    text = _hook().cli_reference()
    for name in COMMANDS:
        assert f"## `autotune {name}`" in text, name
        assert f"usage: autotune {name}" in text, name
    assert "usage: autotune strategies list" in text  # sub-commands get sections too


def test_cli_reference_replaces_the_pages_marker():
    hook = _hook()
    page = (DOCS / "cli.md").read_text(encoding="utf-8")
    assert hook.MARKER in page
    rendered = hook.on_page_markdown(page, page=None)
    assert hook.MARKER not in rendered and "usage: autotune generate" in rendered


def test_readme_is_short_and_its_relative_links_resolve():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    targets = [t for t in LINK.findall(text) if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]
    assert targets, "the README links into docs/"
    missing = [t for t in targets if not t.startswith("#") and not (ROOT / t.split("#")[0]).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"


def test_every_docs_page_is_in_the_nav():
    listed = set()  # `- PAGE`, `Title: PAGE` (nav) and `/PAGE` (not_in_nav) lines of mkdocs.yml
    for line in (ROOT / "mkdocs.yml").read_text(encoding="utf-8").splitlines():
        entry = re.split(r"^\s*- |: ", line.split("#")[0].rstrip())[-1].strip()
        listed.add(entry.lstrip("/"))
    pages = [p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")]
    outside = [p for p in pages if p not in listed]
    assert not outside, f"add these pages to mkdocs.yml's nav: {outside}"
