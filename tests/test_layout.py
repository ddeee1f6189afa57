"""How the tests are laid out: shared helpers live in helper modules (``tests/helpers.py``,
``runtime.testing``), fixtures in ``conftest.py`` files, and no module imports a ``conftest`` or a
``test_*`` module (a test module imported by another runs its module code twice, under two names,
and ties one test file's edits to the other's)."""
from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _forbidden(part: str) -> bool:
    return part == "conftest" or part.startswith("test_")


def offending_imports(tree: ast.AST) -> list[str]:
    """Every import in ``tree`` (lazy ones too) of a ``conftest`` or ``test_*`` module."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if any(map(_forbidden, alias.name.split(".")))]
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            parts = (node.module or "").split(".")
            if any(map(_forbidden, parts)):
                found.append(module)
            elif node.level or parts[0] == "tests":  # `from tests.x import test_y`, `from . import conftest`
                sep = "." if node.module else ""
                found += [f"{module}{sep}{a.name}" for a in node.names if _forbidden(a.name)]
    return found


def test_tests_import_helpers_not_test_modules():
    # the check itself finds what it is for (and passes over helper modules)
    snippets = {
        "from tests.conftest import tiny_model": ["tests.conftest"],
        "from conftest import noisy_copy": ["conftest"],
        "import tests.autotune.test_serve": ["tests.autotune.test_serve"],
        "def f():\n    from tests.autotune.test_serve import LiveServer": ["tests.autotune.test_serve"],
        "from tests.autotune import test_storage": ["tests.autotune.test_storage"],
        "from . import conftest": [".conftest"],
        "from .test_serve import chat": [".test_serve"],
        "from tests.helpers import run\nfrom runtime.testing import tiny_model\n"
        "from tests.runtime.distribution import Case": [],
    }
    for source, expected in snippets.items():
        assert offending_imports(ast.parse(source)) == expected, source
    offenders = {
        str(path.relative_to(TESTS)): found
        for path in sorted(TESTS.rglob("*.py"))
        if (found := offending_imports(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))))
    }
    assert not offenders, (
        f"import shared helpers from tests/helpers.py (or runtime.testing), fixtures through conftest.py: {offenders}"
    )


def _sizes_tool():
    """``tools/sizes.py``, loaded from its path (``tools`` is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("sizes_tool", TESTS.parent / "tools" / "sizes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_library_modules_and_classes_stay_within_the_house_limits(tmp_path):
    sizes = _sizes_tool()
    # the check itself finds what it is for: a planted long module and a planted long class
    pkg = tmp_path / "runtime"
    pkg.mkdir()
    (pkg / "long.py").write_text("x = 1\n" * (sizes.MODULE_LIMIT + 1))
    (pkg / "wide.py").write_text("class Wide:\n" + "    a = 1\n" * sizes.CLASS_LIMIT)
    (pkg / "fine.py").write_text("class Fine:\n    a = 1\n")
    assert sorted(sizes.over(tmp_path)) == [
        f"runtime/long.py {sizes.MODULE_LIMIT + 1} lines > {sizes.MODULE_LIMIT}",
        f"runtime/wide.py:Wide {sizes.CLASS_LIMIT + 1} lines > {sizes.CLASS_LIMIT}",
    ]
    assert sizes.over() == [], "split the module or class (see tools/sizes.py)"
