"""Tests share helpers, not test modules; benchmarks import one another in one direction.

- No file under tests/ or benchmarks/ imports a ``test_*`` module. What two test files share
  lives in a ``conftest.py`` (fixtures) or in ``tests/helpers/`` (builders and checks): a test
  file imported by another is a helper waiting to move (and a fixture imported from one is
  read by pyflakes as redefined by every test that takes it).
- No module of benchmarks/ imports itself back through others (``benchmarks.serving`` and
  ``benchmarks.serving_sweep`` once did): what two scripts share lives in a module both import.

Imports are read from the syntax tree wherever they sit, a function's lazy import and one under
``TYPE_CHECKING`` included, as ``lint-imports`` reads pdserve's (``tests/test_layers.py``). The
last test plants one of each in a small tree of its own: the checks see them."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("tests", "benchmarks")


def python_files(root: Path, folder: str) -> list[Path]:
    return sorted(p for p in (root / folder).rglob("*.py") if "__pycache__" not in p.parts)


def module_of(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(root: Path, path: Path) -> Iterator[tuple[int, str]]:
    """(line, module name) of every import in ``path``; for ``from a import b`` both ``a`` and
    ``a.b`` (``b`` may be a module). Relative imports are resolved; so is a constant name given
    to ``importlib.import_module`` or ``__import__``."""
    package = module_of(root, path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] + [node.module or ""]) if node.level else node.module
            base = base.strip(".")
            yield node.lineno, base
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and (getattr(node.func, "attr", None) == "import_module" or getattr(node.func, "id", None) in
                   ("import_module", "__import__"))):
            yield node.lineno, node.args[0].value


def is_test_module(root: Path, name: str) -> bool:
    """``name`` is a module of this repository whose file is ``test_*.py``."""
    parts = name.split(".")
    return parts[-1].startswith("test_") and root.joinpath(*parts).with_suffix(".py").is_file()


def find_test_module_imports(root: Path) -> list[str]:
    found = []
    for folder in FOLDERS:
        for path in python_files(root, folder):
            for line, name in imports(root, path):
                if is_test_module(root, name):
                    found.append(f"{path.relative_to(root)}:{line} imports {name}")
    return sorted(set(found))


def benchmark_cycles(root: Path) -> list[list[str]]:
    """Each cycle of the graph of imports between modules of benchmarks/ (its strongly connected
    components of more than one module, and any module that imports itself), as the modules in it."""
    modules = {module_of(root, p): p for p in python_files(root, "benchmarks")}
    graph = {m: sorted({n for _, n in imports(root, p) if n in modules}) for m, p in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:  # Tarjan's strongly connected components
        index[m] = low[m] = len(index)
        stack.append(m)
        for n in graph[m]:
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            component = []
            while True:
                n = stack.pop()
                component.append(n)
                if n == m:
                    break
            if len(component) > 1 or m in graph[m]:
                cycles.append(sorted(component))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return sorted(cycles)


def test_no_file_under_tests_or_benchmarks_imports_a_test_module():
    found = find_test_module_imports(ROOT)
    assert not found, ("move what is shared into a conftest.py (fixtures) or tests/helpers/ (the rest):\n"
                       + "\n".join(found))


def test_no_benchmarks_modules_import_each_other_in_a_cycle():
    cycles = benchmark_cycles(ROOT)
    assert not cycles, ("move what these modules share into one that each imports:\n"
                        + "\n".join(" <-> ".join(c) for c in cycles))


def test_the_checks_see_a_planted_test_import_and_a_planted_cycle(tmp_path):
    files = {
        "tests/__init__.py": "",
        "tests/helpers/__init__.py": "",
        "tests/helpers/chat.py": "def ask(): ...\n",
        "tests/a/__init__.py": "",
        "tests/a/test_one.py": "from tests.helpers.chat import ask\n",
        "tests/a/test_two.py": "def test_x():\n    from .test_one import ask\n",  # lazy and relative
        "tests/a/test_three.py": "from tests.a import test_one\n",
        "benchmarks/low.py": "X = 1\n",
        "benchmarks/up.py": "from benchmarks.low import X\n",
        "benchmarks/one.py": "import benchmarks.up\n\ndef f():\n    from benchmarks import two\n",
        "benchmarks/two.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import benchmarks.one\n",
        "benchmarks/script.py": "import sys\nsys.path.insert(0, '.')\nfrom tests.a.test_one import ask  # noqa\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert find_test_module_imports(tmp_path) == ["benchmarks/script.py:3 imports tests.a.test_one",
                                             "tests/a/test_three.py:1 imports tests.a.test_one",
                                             "tests/a/test_two.py:2 imports tests.a.test_one"]
    assert benchmark_cycles(tmp_path) == [["benchmarks.one", "benchmarks.two"]]
    for name in ("tests/a/test_two.py", "tests/a/test_three.py", "benchmarks/script.py", "benchmarks/two.py"):
        (tmp_path / name).unlink()
    assert find_test_module_imports(tmp_path) == [] and benchmark_cycles(tmp_path) == []
