"""The subpackages of ``pdserve`` import each other only in the order docs/architecture.md
gives: engine and protos, then kv_transfer, then wire (the worker shell), then the two
workers and the router, then cluster, then planner. A module may import its own subpackage
and any subpackage of an earlier layer; never one of its own layer or a later one.

Today's exceptions are listed one import at a time in ``KNOWN_VIOLATIONS``: a new import
against the order fails here, and so does an exception that is gone (strike it from the list).
Imports are read with ``ast``, wherever they sit (a function's lazy import counts)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LAYERS = (
    ("engine", "protos"),
    ("kv_transfer",),
    ("wire",),
    ("prefill_worker", "decode_worker", "router"),
    ("cluster",),
    ("planner",),
)
LAYER_OF = {pkg: rank for rank, pkgs in enumerate(LAYERS) for pkg in pkgs}

# (importing module, imported module): the exceptions docs/architecture.md names, one line each.
KNOWN_VIOLATIONS = {
    # kv_transfer's tcp backend takes the internal plane's mTLS from wire.
    ("pdserve.kv_transfer.tcp_backend", "pdserve.wire.tls"),
    # wire's plain-process entry point starts either worker, with the cluster's declared settings.
    ("pdserve.wire.worker_process", "pdserve.prefill_worker.server"),
    ("pdserve.wire.worker_process", "pdserve.prefill_worker.worker"),
    ("pdserve.wire.worker_process", "pdserve.decode_worker.server"),
    ("pdserve.wire.worker_process", "pdserve.decode_worker.worker"),
    ("pdserve.wire.worker_process", "pdserve.cluster.settings"),
    # The CLI registers the planner's `plan` and `profile`.
    ("pdserve.cluster.cli", "pdserve.planner.cli"),
}


def module_name(path: Path, root: Path) -> str:
    """``pdserve/router/pool.py`` -> ``pdserve.router.pool``; a package's ``__init__`` is the package."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, module: str) -> set[str]:
    """Every absolute name ``path`` imports (a module, or a name inside one), relative imports
    resolved."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            name = ".".join(base + ([node.module] if node.module else []))
            # `from pdserve.wire import tls` names the module pdserve.wire.tls; `from
            # pdserve.router.pool import X` names X in pdserve.router.pool (existing_module trims it)
            found |= {f"{name}.{alias.name}" for alias in node.names}
    return found


def violations(root: Path) -> set[tuple[str, str]]:
    """(importer, imported) for each import of ``root``/pdserve against the layer order; an
    imported name is reported as the longest module of it that exists (not the attribute)."""
    out = set()
    for path in sorted((root / "pdserve").rglob("*.py")):
        importer = module_name(path, root)
        if importer.count(".") < 1:
            continue  # pdserve/__init__.py
        own = importer.split(".")[1]
        for name in imported_modules(path, importer):
            parts = name.split(".")
            if parts[0] != "pdserve" or len(parts) < 2 or parts[1] == own or parts[1] not in LAYER_OF:
                continue
            if LAYER_OF[parts[1]] >= LAYER_OF[own]:
                out.add((importer, existing_module(root, parts)))
    return out


def existing_module(root: Path, parts: list[str]) -> str:
    """The longest prefix of ``parts`` that is a module or package under ``root``."""
    for end in range(len(parts), 1, -1):
        path = root.joinpath(*parts[:end])
        if path.with_suffix(".py").exists() or (path / "__init__.py").exists():
            return ".".join(parts[:end])
    return ".".join(parts[:2])


def test_every_subpackage_has_a_layer():
    packages = {p.name for p in (ROOT / "pdserve").iterdir() if (p / "__init__.py").exists()}
    assert packages == set(LAYER_OF), "a new subpackage needs its place in LAYERS (and docs/architecture.md)"


def test_no_import_runs_against_the_layer_order():
    found = violations(ROOT)
    new = sorted(found - KNOWN_VIOLATIONS)
    assert not new, "imports against docs/architecture.md's layer order:\n" + "\n".join(f"  {a} -> {b}" for a, b in new)


def test_every_known_violation_still_exists():
    gone = sorted(KNOWN_VIOLATIONS - violations(ROOT))
    assert not gone, "no longer imported; strike from KNOWN_VIOLATIONS:\n" + "\n".join(f"  {a} -> {b}" for a, b in gone)


def test_the_check_sees_lazy_relative_and_from_imports(tmp_path):
    # A tree of its own: engine importing router three ways, one of them inside a function.
    for pkg in LAYER_OF:
        (tmp_path / "pdserve" / pkg).mkdir(parents=True)
        (tmp_path / "pdserve" / pkg / "__init__.py").write_text("")
    (tmp_path / "pdserve" / "router" / "pool.py").write_text("X = 1\n")
    (tmp_path / "pdserve" / "engine" / "a.py").write_text("import pdserve.router.pool\n")
    (tmp_path / "pdserve" / "engine" / "b.py").write_text("def f():\n    from ..router import pool\n")
    (tmp_path / "pdserve" / "engine" / "c.py").write_text("from pdserve.router.pool import X\n")
    (tmp_path / "pdserve" / "router" / "ok.py").write_text("from pdserve.engine import a\nfrom . import pool\n")
    assert violations(tmp_path) == {(f"pdserve.engine.{m}", "pdserve.router.pool") for m in "abc"}
