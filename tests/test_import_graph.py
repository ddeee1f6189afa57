"""The project's import graph: no cycles (module-level, lazy and TYPE_CHECKING imports alike) and
dependencies that point one way: ``autotune -> {runtime, search_spaces, studies}``,
``runtime -> search_spaces``, ``search_spaces`` and ``studies`` on their own (docs/design.md, Packages)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("autotune", "runtime", "search_spaces", "studies")
# which of the project's top-level packages each one may import (itself always)
ALLOWED = {
    "autotune": {"runtime", "search_spaces", "studies"},
    "runtime": {"search_spaces"},
    "search_spaces": set(),
    "studies": set(),
}
# inside ``autotune``: (importer, imported) package pairs no module may form; a module inside the
# imported package itself is exempt, so ``autotune`` -> ``autotune.cli`` bars only library modules
FORBIDDEN = (
    ("autotune.serving", "autotune.measure"),
    ("autotune.measure", "autotune.serving"),
    ("autotune", "autotune.cli"),
)


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the project's packages."""
    mods = {}
    for pkg in PACKAGES:
        for f in sorted((root / pkg).rglob("*.py")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = f
    return mods


def _imported(module: str, is_package: bool, tree: ast.AST) -> set[str]:
    """Every name ``module`` imports, anywhere in it (``from X import Y`` yields X and X.Y)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".") if is_package else module.split(".")[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports (a submodule import does not count its parent
    packages: Python runs a package's ``__init__`` before its submodules, never in a loop)."""
    graph = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        found = _imported(name, path.name == "__init__.py", tree)
        graph[name] = {m for m in found if m in mods and m != name}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    cycles.append(sorted(comp))
    return sorted(cycles)


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    """``a -> b`` edges whose top-level packages ``ALLOWED`` does not permit."""
    bad = []
    for src, deps in sorted(graph.items()):
        top = src.split(".")[0]
        for dst in sorted(deps):
            other = dst.split(".")[0]
            if other != top and other not in ALLOWED[top]:
                bad.append(f"{src} -> {dst}")
    return bad


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def inner_violations(graph: dict[str, set[str]]) -> list[str]:
    """``a -> b`` edges inside ``autotune`` that ``FORBIDDEN`` bars."""
    return [f"{src} -> {dst}" for src, deps in sorted(graph.items()) for dst in sorted(deps)
            if any(_within(src, a) and _within(dst, b) and not _within(src, b) for a, b in FORBIDDEN)]


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(project_modules())


def test_no_import_cycle(graph: dict[str, set[str]]) -> None:
    assert find_cycles(graph) == []


def test_dependencies_point_one_way(graph: dict[str, set[str]]) -> None:
    assert layering_violations(graph) == []


def test_autotune_layers_point_one_way(graph: dict[str, set[str]]) -> None:
    """Serving and measuring never import each other; no library module imports the CLI."""
    assert inner_violations(graph) == []


def test_the_graph_sees_the_project(graph: dict[str, set[str]]) -> None:
    """The walk found the packages and their edges (an empty graph would pass everything)."""
    assert {"autotune.tuning.tuner", "runtime.decoding", "search_spaces.strategy", "studies.tasks"} <= set(graph)
    assert "runtime.draft" in graph["runtime.decoding"]
    assert "search_spaces.strategy" in graph["autotune.tuning.tuner"]
    assert {"autotune.serving.server", "autotune.measure.replay", "autotune.cli.main"} <= set(graph)
    assert "autotune.measure.replay" in graph["autotune.cli.replay"]


def _write(root: Path, files: dict[str, str]) -> dict[str, Path]:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return project_modules(root)


def test_a_cycle_is_found_even_through_lazy_and_relative_imports(tmp_path: Path) -> None:
    """Power check: the walk fails on the cycles the project once had (a lazy import inside a
    function, a relative import, a TYPE_CHECKING import)."""
    mods = _write(tmp_path, {
        "runtime/__init__.py": "",
        "runtime/drafters.py": "def f():\n    from runtime.lookup import L\n",
        "runtime/lookup.py": "from .drafters import f\n",
        "runtime/layer_exec.py": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from runtime.transformer import C\n"
        ),
        "runtime/transformer.py": "import runtime.layer_exec\n",
        "autotune/__init__.py": "", "search_spaces/__init__.py": "", "studies/__init__.py": "",
    })
    assert find_cycles(import_graph(mods)) == [
        ["runtime.drafters", "runtime.lookup"], ["runtime.layer_exec", "runtime.transformer"],
    ]


@pytest.mark.parametrize("src, text", [
    ("runtime/x.py", "from autotune.tuning import tuner\n"),
    ("search_spaces/x.py", "def f():\n    import runtime.decoding\n"),
    ("studies/x.py", "from autotune import errors\n"),
])
def test_an_import_against_the_layering_is_found(tmp_path: Path, src: str, text: str) -> None:
    """Power check: ``runtime`` importing ``autotune``, ``search_spaces`` importing ``runtime``
    (even lazily) and ``studies`` importing ``autotune`` are each reported."""
    mods = _write(tmp_path, {
        "autotune/__init__.py": "", "autotune/errors.py": "", "autotune/tuning/__init__.py": "",
        "autotune/tuning/tuner.py": "", "runtime/__init__.py": "", "runtime/decoding.py": "",
        "search_spaces/__init__.py": "", "studies/__init__.py": "", src: text,
    })
    module = src[:-3].replace("/", ".")
    found = layering_violations(import_graph(mods))
    assert found and all(v.startswith(f"{module} -> ") for v in found)


_AUTOTUNE_TREE = {
    "autotune/__init__.py": "", "autotune/cli/__init__.py": "", "autotune/cli/main.py": "",
    "autotune/measure/__init__.py": "", "autotune/measure/steps.py": "",
    "autotune/serving/__init__.py": "", "autotune/serving/protocol.py": "",
    "autotune/choices.py": "", "runtime/__init__.py": "", "search_spaces/__init__.py": "", "studies/__init__.py": "",
}


@pytest.mark.parametrize("src, text", [
    ("autotune/serving/worker.py", "def f():\n    from autotune.measure.steps import time_steps\n"),
    ("autotune/measure/replay.py", "from autotune.serving.protocol import STRATEGY_CHOICES\n"),
    ("autotune/measure/replay.py", "def f():\n    from ..serving import protocol\n"),
    ("autotune/reports/table.py", "import autotune.cli.main\n"),
    ("autotune/serving/adaptive/settings.py", "from autotune.cli import main\n"),
])
def test_an_import_against_the_autotune_layers_is_found(tmp_path: Path, src: str, text: str) -> None:
    """Power check: serving importing measuring (even lazily), measuring importing serving (even
    relatively) and a library module importing the CLI are each reported."""
    mods = _write(tmp_path, {**_AUTOTUNE_TREE, src: text})
    module = src[:-3].replace("/", ".")
    found = inner_violations(import_graph(mods))
    assert found and all(v.startswith(f"{module} -> ") for v in found)


def test_allowed_autotune_imports_are_not_reported(tmp_path: Path) -> None:
    """Power check the other way: the CLI importing serving and measuring, and both importing a
    module they share, are allowed."""
    mods = _write(tmp_path, {
        **_AUTOTUNE_TREE,
        "autotune/cli/serve.py": "from autotune.serving import protocol\nfrom autotune.cli import main\n",
        "autotune/cli/replay.py": "from autotune.measure import steps\n",
        "autotune/serving/app.py": "from autotune.choices import STRATEGY_CHOICES\n",
        "autotune/measure/replay.py": "from autotune.choices import STRATEGY_CHOICES\n",
    })
    graph = import_graph(mods)
    assert "autotune.serving.protocol" in graph["autotune.cli.serve"]
    assert inner_violations(graph) == []
