"""No hand-written source file passes 400 lines (docs/testing.md): a file is one idea a reader
holds at once. Generated code (the gRPC stubs) is left out."""

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 400
SOURCES = (".py", ".cpp", ".h", ".sh")


def test_no_hand_written_source_passes_400_lines():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    long = {}
    for name in files:
        path = ROOT / name
        if name.endswith(SOURCES) and "_pb2" not in name and path.is_file():
            lines = len(path.read_text(errors="replace").splitlines())
            if lines > MAX_LINES:
                long[name] = lines
    assert not long, f"over {MAX_LINES} lines: {long}"
