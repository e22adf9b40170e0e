"""``lease_seconds``, ``transfer_timeout_seconds`` and ``drain_grace_seconds`` are each declared once, in ``pdserve.cluster.settings``:
every parser that takes one reads its default, help and bounds from that declaration, the
worker configs take the value passed down, and no other source file writes a default of its own."""

import ast
import dataclasses
import os
from pathlib import Path

import pytest

from pdserve.cli import main
from pdserve.cluster import cli, worker_cli
from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.settings import DRAIN_GRACE_SECONDS, LEASE_SECONDS, TRANSFER_TIMEOUT_SECONDS, serve_settings
from pdserve.decode_worker.worker import DecodeWorkerConfig
from pdserve.prefill_worker.config import PrefillWorkerConfig
from pdserve.cluster import worker_process

ROOT = Path(__file__).resolve().parents[2]
SPELLINGS = {"lease_seconds": ("lease_seconds", "lease-seconds"), "drain_grace": ("drain_grace", "drain-grace"),
             "transfer_timeout": ("transfer_timeout", "transfer-timeout")}


def source_files() -> list[Path]:
    """Every .py file outside the tests, the generated protobuf modules and hidden or build directories."""
    out = []
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("tests", "build", "dist", "__pycache__")
                   and not d.endswith(".egg-info")]
        out += [Path(top) / f for f in files if f.endswith(".py") and "_pb2" not in f]
    return out


def _numeric(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) in (int, float)


def _spelled(node: ast.AST, spellings: tuple[str, ...]) -> bool:
    text = (node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else
            node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else
            node.arg if isinstance(node, ast.arg) else "")
    return any(s in text.lower() for s in spellings)


def defaults_written(tree: ast.AST, spellings: tuple[str, ...]) -> set[int]:
    """Lines that write a number as the setting's default: a name spelled like it assigned a
    number (a dataclass field, a constant), a parameter spelled like it with a number as its
    default, or a call that names it in a string beside a number given positionally or as
    ``default=`` (``Setting(...)``, ``add_argument(...)``, ``getattr(...)``). A value passed as
    a keyword (``ClusterConfig(lease_seconds=60.0)``) is a choice, not a default."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            named = any(_spelled(a, spellings) for a in [*node.args, *(k.value for k in node.keywords)])
            number = any(_numeric(a) for a in node.args) or any(k.arg == "default" and _numeric(k.value)
                                                                 for k in node.keywords)
            if named and number:
                lines.add(node.lineno)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(_spelled(t, spellings) for t in targets) and any(_numeric(n) for n in ast.walk(node.value)):
                lines.add(node.lineno)
        elif isinstance(node, ast.arguments):
            params = [*node.posonlyargs, *node.args]
            pairs = [*zip(params[len(params) - len(node.defaults):], node.defaults), *zip(node.kwonlyargs, node.kw_defaults)]
            lines |= {d.lineno for p, d in pairs if d is not None and _spelled(p, spellings) and _numeric(d)}
    return lines


@pytest.mark.parametrize("setting", sorted(SPELLINGS))
def test_the_source_tree_writes_each_default_once_in_the_settings_table(setting):
    found = [f"{path.relative_to(ROOT)}:{line}" for path in source_files()
             for line in sorted(defaults_written(ast.parse(path.read_text()), SPELLINGS[setting]))]
    assert len(found) == 1 and found[0].startswith("pdserve/cluster/settings.py:"), found


def test_the_scan_sees_a_second_default_where_one_is_written():
    """The check above could pass by seeing nothing: each form it must catch, caught."""
    for source in ("lease_seconds: float = 30.0", "DEFAULT_LEASE_SECONDS = 30.0", "def f(lease_seconds=30.0): pass",
                   "p.add_argument('--lease-seconds', type=float, default=30.0)",
                   "Setting('lease_seconds', float, 30.0, 'help')", "getattr(config, 'lease_seconds', 30.0)"):
        assert defaults_written(ast.parse(source), SPELLINGS["lease_seconds"]), source
    assert not defaults_written(ast.parse("ClusterConfig(lease_seconds=60.0)"), SPELLINGS["lease_seconds"])


def test_the_settings_tables_hold_the_declarations_themselves():
    for table in (serve_settings(), worker_cli.worker_settings()):
        for declared in (LEASE_SECONDS, TRANSFER_TIMEOUT_SECONDS, DRAIN_GRACE_SECONDS):
            assert any(s is declared for s in table), declared.name


def test_the_configs_take_the_value_passed_down():
    for config, name in ((PrefillWorkerConfig, "lease_seconds"), (DecodeWorkerConfig, "transfer_timeout_s")):
        value = {f.name: f for f in dataclasses.fields(config)}[name]
        assert value.default is dataclasses.MISSING and value.default_factory is dataclasses.MISSING
        with pytest.raises(TypeError, match=name):
            config()
    for config in (PrefillWorkerConfig, DecodeWorkerConfig):  # the grace is the drain's argument
        assert not [f.name for f in dataclasses.fields(config) if "drain_grace" in f.name]
    assert ClusterConfig().lease_seconds == LEASE_SECONDS.default
    assert ClusterConfig().transfer_timeout_s == TRANSFER_TIMEOUT_SECONDS.default


def test_the_plain_worker_process_reads_default_and_bounds_from_the_declarations(capsys):
    parser = worker_process._parser()
    args = parser.parse_args(["prefill"])
    assert (args.lease_seconds, args.transfer_timeout_seconds, args.drain_grace_s) == (
        LEASE_SECONDS.default, TRANSFER_TIMEOUT_SECONDS.default, DRAIN_GRACE_SECONDS.default)
    for bad in (["--lease-seconds", "0"], ["--transfer-timeout-seconds", "0"], ["--drain-grace-s", "-1"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["prefill", *bad])
    assert "must be" in capsys.readouterr().err


def test_pdserve_stop_reads_default_and_bounds_from_the_declaration(monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(cli, "cluster_stop", lambda args: seen.append(args.drain_grace_seconds) or 0)
    assert main(["stop", "--address", "127.0.0.1:6379"]) == 0
    assert seen == [DRAIN_GRACE_SECONDS.default]
    with pytest.raises(SystemExit):
        main(["stop", "--address", "127.0.0.1:6379", "--drain-grace-seconds", "-1"])
    assert "drain_grace_seconds must be at least 0" in capsys.readouterr().err
