"""Generate (or check) the Python code for every ``pdserve/protos/*.proto``.

Run from anywhere: ``python pdserve/protos/generate.py`` rewrites ``pdserve/protos/<name>_pb2.py`` and
``pdserve/protos/<name>_pb2.pyi`` (plus ``pdserve/protos/<name>_pb2_grpc.py`` when the file declares a
service). protoc runs with ``-I <repo root>`` so generated imports read
``from pdserve.protos import x_pb2``.

``python pdserve/protos/generate.py --check`` regenerates into a temporary directory, compares with
the committed files and exits 1 naming every stale, missing or orphaned generated file.
"""

from __future__ import annotations

import argparse
import filecmp
import re
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = Path("pdserve") / "protos"  # relative to the repository root, as protoc sees it
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
# A service declaration at the start of a line; comments mentioning "service" do not count.
_SERVICE_RE = re.compile(r"^\s*service\s+\w+\s*\{", re.MULTILINE)


def proto_files(root: Path = REPO_ROOT) -> list[Path]:
    """All ``.proto`` sources under ``<root>/pdserve/protos/``, sorted for a stable order."""
    return sorted((root / PROTO_DIR).glob("*.proto"))


def has_service(proto: Path) -> bool:
    """Whether the proto declares a gRPC service (then ``_pb2_grpc.py`` is generated)."""
    return bool(_SERVICE_RE.search(proto.read_text()))


def expected_outputs(proto: Path) -> list[str]:
    """Generated file names (relative to ``pdserve/protos/``) for one proto source."""
    names = [f"{proto.stem}_pb2.py", f"{proto.stem}_pb2.pyi"]
    if has_service(proto):
        names.append(f"{proto.stem}_pb2_grpc.py")
    return names


def generate(out_root: Path, root: Path = REPO_ROOT) -> None:
    """Run protoc over every proto of ``root``, writing ``<out_root>/pdserve/protos/*``.

    Raises RuntimeError naming the proto when protoc fails.
    """
    # Imported here so ``--help`` works without grpcio-tools installed.
    from importlib.resources import files

    from grpc_tools import protoc

    well_known = str(files("grpc_tools") / "_proto")  # google/protobuf/*.proto
    (out_root / PROTO_DIR).mkdir(parents=True, exist_ok=True)
    for proto in proto_files(root):
        rel = proto.relative_to(root).as_posix()
        args = ["grpc_tools.protoc", f"-I{root}", f"-I{well_known}",
                f"--python_out={out_root}", f"--pyi_out={out_root}"]
        if has_service(proto):
            args.append(f"--grpc_python_out={out_root}")
        if protoc.main(args + [rel]) != 0:
            raise RuntimeError(f"protoc failed on {rel}")


def check(root: Path = REPO_ROOT) -> list[str]:
    """Return one line per stale, missing or orphaned generated file under ``root``."""
    proto_dir = root / PROTO_DIR
    problems: list[str] = []
    expected: set[str] = set()
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp), root)
        for proto in proto_files(root):
            for name in expected_outputs(proto):
                expected.add(name)
                fresh, committed = Path(tmp) / PROTO_DIR / name, proto_dir / name
                if not committed.exists():
                    problems.append(f"pdserve/protos/{name}: missing (generated from {proto.name})")
                elif not filecmp.cmp(fresh, committed, shallow=False):
                    problems.append(f"pdserve/protos/{name}: stale (differs from {proto.name})")
    present = {p.name for p in proto_dir.iterdir() if p.name.endswith(GENERATED_SUFFIXES)}
    for name in sorted(present - expected):
        problems.append(f"pdserve/protos/{name}: orphaned (no matching .proto)")
    return problems


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="verify committed generated code is fresh; exit 1 if not")
    parser.add_argument("--root", type=Path, default=REPO_ROOT,
                        help="repository root holding pdserve/protos/ (default: this checkout)")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    if args.check:
        problems = check(root)
        for line in problems:
            print(line, file=sys.stderr)
        if problems:
            print("generated code is out of date: run `python pdserve/protos/generate.py`",
                  file=sys.stderr)
            return 1
        print(f"{len(proto_files(root))} proto file(s): generated code is fresh")
        return 0
    generate(root, root)
    print(f"generated code for {len(proto_files(root))} proto file(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
