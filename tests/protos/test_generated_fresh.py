"""The committed generated protobuf code matches what pdserve/protos/generate.py produces."""

import shutil
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
GENERATE = REPO_ROOT / "pdserve" / "protos" / "generate.py"


def _run_check(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(GENERATE), "--check", "--root", str(root)],
                          capture_output=True, text=True, timeout=120)


def test_committed_generated_code_is_fresh():
    result = _run_check(REPO_ROOT)
    assert result.returncode == 0, result.stderr


def test_check_names_stale_and_orphaned_files(tmp_path):
    # A copy of pdserve/protos/ with one generated file edited and one orphan: --check must fail
    # and name both, otherwise the freshness test above could never fail.
    copy = tmp_path / "pdserve" / "protos"
    shutil.copytree(REPO_ROOT / "pdserve" / "protos", copy, ignore=shutil.ignore_patterns("__pycache__"))
    stale = copy / "kv_transfer_pb2.py"
    stale.write_text(stale.read_text() + "\n# hand edit\n")
    (copy / "gone_pb2.py").write_text("")
    result = _run_check(tmp_path)
    assert result.returncode == 1
    assert "pdserve/protos/kv_transfer_pb2.py: stale" in result.stderr
    assert "pdserve/protos/gone_pb2.py: orphaned" in result.stderr
