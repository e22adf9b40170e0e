"""The import contracts in pyproject.toml (``[tool.importlinter]``, checked by ``lint-imports`` in
``make test``) catch what they are there for. Run on a small tree of their own, they must see:

- an import against the layer order inside a function, written relative;
- a loop between two files of one package that closes only under ``TYPE_CHECKING``.

The same tree without those files passes, so the failure is theirs and not the set-up's. The
real tree is checked by ``make test`` itself."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]


def _tree(root: Path) -> None:
    """Every subpackage the layers contract names, with one import each way it allows, and the
    known exception of the cycle contract (so that its ignore matches an import)."""
    layers = next(c for c in CONFIG["contracts"] if c["type"] == "layers")
    names = [n.strip() for layer in layers["layers"] for n in layer.split("|")]
    (root / "pdserve").mkdir()
    (root / "pdserve" / "__init__.py").write_text("")
    for name in names:
        if name == "cli":
            (root / "pdserve" / "cli.py").write_text("import pdserve.planner\n")
            continue
        (root / "pdserve" / name).mkdir()
        (root / "pdserve" / name / "__init__.py").write_text("")
    (root / "pdserve" / "router" / "pool.py").write_text("from pdserve.engine import sampling\n")
    (root / "pdserve" / "engine" / "sampling.py").write_text("X = 1\n")
    for importer, imported in (i.split(" -> ") for c in CONFIG["contracts"] for i in c.get("ignore_imports", ())):
        for module, other in ((importer, imported), (imported, importer)):
            path = root.joinpath(*module.split(".")).with_suffix(".py")
            path.write_text(f"import {other}\n")


def _lint(root: Path) -> subprocess.CompletedProcess:
    (root / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    lint = Path(sys.executable).with_name("lint-imports")
    # The tree in ``root`` comes before the installed pdserve on the path.
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(lint), "--no-logo", "--no-cache"], cwd=root, env=env, capture_output=True,
                          text=True, timeout=120)


def test_a_tree_in_order_passes(tmp_path):
    _tree(tmp_path)
    result = _lint(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_contracts_see_lazy_relative_and_type_checking_imports(tmp_path):
    _tree(tmp_path)
    engine = tmp_path / "pdserve" / "engine"
    (engine / "lazy.py").write_text("def f():\n    from ..router import pool\n    return pool\n")
    (engine / "typed.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                                     "    from pdserve.engine import plain\n")
    (engine / "plain.py").write_text("from . import typed\n")
    result = _lint(tmp_path)
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert "pdserve.engine.lazy -> pdserve.router.pool" in out
    assert "No cycles are allowed in pdserve.engine." in out
    assert "pdserve.router." not in out.split("No cycles are allowed", 1)[1]  # the known exception stays ignored
