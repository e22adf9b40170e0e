"""`make gpu-bundle`: what the lent GPU host lacks for scripts/gpu_check.sh and scripts/gpu_bench.sh.

The host (docs/gpu.md, "GPU check") has Python 3.12, a CUDA 13 torch, numpy, transformers,
tokenizers, safetensors, pytest, grpcio and xxhash, and no network; at most 64 MiB travel
with the checkout. This writes ``gpu_bundle/`` (git-ignored), under 40 MiB:

- ``wheels/``: the wheels pdserve's engine, the check, and a served cluster of plain
  ``pdserve worker`` processes (the bench) import that the host lacks (``GPU_WHEELS``), for
  CPython 3.12 on manylinux x86-64, without their dependencies, so pip never replaces the
  host's numpy, torch or transformers. Ray is not carried (too large): the bench's cluster runs
  without it.
- ``nixl_cu13_ucx.tar.gz``: a subset of the ``nixl-cu13`` wheel (59 MB), laid out as in
  site-packages (so it unpacks straight into the private target directory): its
  Python package, its metadata, libnixl, the UCX plugin, and the UCX transports a
  VRAM-to-VRAM read can take (CUDA copy and IPC, shared memory, TCP); then every library
  those link, found by following their ELF ``NEEDED`` entries through their ``RPATH``s. The
  storage plugins (S3, Azure, GDS, ...), InfiniBand transports and the expert-parallel
  kernels are left out. Unpacked it is about 42 MB (libnixl links gRPC and etcd's client);
  packed, about 12.

scripts/gpu_check.sh installs both into a private ``--target`` directory on the host.
Usage: ``python scripts/gpu_bundle.py [--out gpu_bundle] [--python-version 3.12]``.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

# name==version, as in requirements.lock where pdserve pins them. xgrammar and its closure;
# protobuf 7 and grpcio (the generated code in pdserve/protos checks for both: the lent host's
# grpcio 1.84 refused worker_pb2_grpc, which the reversed pull's device test imports, with the
# workers' gRPC servers and their health service).
GPU_WHEELS = [
    "xgrammar==0.2.8", "apache-tvm-ffi==0.1.15.post2", "pydantic==2.14.3", "pydantic_core==2.50.4",
    "annotated-types==0.8.0", "typing-inspection==0.4.5", "typing_extensions==4.16.0", "protobuf==7.36.2",
    "grpcio==1.85.1", "grpcio-health-checking==1.85.1",
    # What a served cluster imports that the host lacks (scripts/gpu_bench.sh starts `pdserve worker`
    # processes and drives them with benchmarks/load): the router's and the load generator's HTTP
    # (aiohttp and its closure), the workers' /metrics, the public plane's gRPC reflection.
    "aiohttp==3.14.5", "aiohappyeyeballs==2.7.1", "aiosignal==1.4.0", "attrs==26.1.0", "frozenlist==1.8.0",
    "multidict==7.2.1", "propcache==0.5.4", "yarl==1.25.1", "idna==3.20", "prometheus_client==0.26.0",
    "grpcio-reflection==1.85.1",
]
NIXL_WHEEL = "nixl-cu13==1.5.1"
# The wheel's own files that start the link walk; every other file is taken only if linked.
NIXL_ROOTS = [
    "nixl_cu13/*.py", "nixl_cu13/*.so", "nixl_cu13/py.typed", "nixl_cu13-*.dist-info/*",
    ".nixl_cu13.mesonpy.libs/plugins/libplugin_UCX.so",
    "nixl_cu13.libs/ucx/libuct_cuda.so*", "nixl_cu13.libs/ucx/libucm_cuda.so*",
    "nixl_cu13.libs/ucx/libuct_cma.so*",
]
# Never carried: the host has them, and a second copy would shadow the host's.
HOST_PACKAGES = ("torch", "numpy", "transformers", "tokenizers", "safetensors", "huggingface_hub")
NIXL_ARCHIVE = "nixl_cu13_ucx.tar.gz"
LIMIT_BYTES = 40 * 2**20
PLATFORMS = ["manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_28_x86_64", "manylinux_2_34_x86_64"]


def download(specs: list[str], dest: Path, python_version: str) -> None:
    plats = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--implementation", "cp", "--python-version", python_version, *plats, "-d", str(dest),
                    *specs], check=True)


def elf_links(path: Path) -> tuple[list[str], list[str]]:
    """(NEEDED names, RPATH/RUNPATH directories with $ORIGIN resolved) of one ELF file."""
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    needed, dirs = [], []
    for line in out.splitlines():
        if "(NEEDED)" in line:
            needed.append(line.split("[", 1)[1].rstrip("]"))
        elif "(RPATH)" in line or "(RUNPATH)" in line:
            for d in line.split("[", 1)[1].rstrip("]").split(":"):
                dirs.append(d.replace("$ORIGIN", str(path.parent)))
    return needed, dirs


def link_closure(tree: Path, roots: list[Path]) -> set[Path]:
    """``roots`` and every file under ``tree`` they link, transitively (system libraries,
    which resolve outside ``tree``, are the host's)."""
    keep, todo = set(), list(roots)
    while todo:
        path = todo.pop()
        if path in keep:
            continue
        keep.add(path)
        if path.suffix not in (".so",) and ".so." not in path.name:
            continue
        needed, dirs = elf_links(path)
        for name in needed:
            for d in dirs:
                candidate = Path(d).resolve() / name
                if candidate.is_file() and candidate.resolve().is_relative_to(tree.resolve()):
                    todo.append(candidate.resolve())
                    break
    return keep


def nixl_subset(wheel: Path, archive: Path) -> list[str]:
    """Unpack ``wheel`` and pack the link closure of ``NIXL_ROOTS`` into ``archive`` (tar.gz),
    paths relative to site-packages; returns them."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp).resolve()
        zipfile.ZipFile(wheel).extractall(tree)
        roots = [p.resolve() for pattern in NIXL_ROOTS for p in tree.glob(pattern) if p.is_file()]
        kept = sorted(str(p.relative_to(tree)) for p in link_closure(tree, roots))
        with tarfile.open(archive, "w:gz") as tar:
            for name in kept:
                tar.add(tree / name, arcname=name)
        return kept


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("gpu_bundle"))
    ap.add_argument("--python-version", default="3.12")
    args = ap.parse_args(argv)
    shutil.rmtree(args.out, ignore_errors=True)
    (args.out / "wheels").mkdir(parents=True)
    download(GPU_WHEELS, args.out / "wheels", args.python_version)
    with tempfile.TemporaryDirectory() as tmp:
        download([NIXL_WHEEL], Path(tmp), args.python_version)
        kept = nixl_subset(next(Path(tmp).glob("nixl_cu13-*.whl")), args.out / NIXL_ARCHIVE)
    size = folder_bytes(args.out)
    print(f"{args.out}: {size / 2**20:.1f} MiB ({len(list((args.out / 'wheels').glob('*.whl')))} wheels; "
          f"NIXL subset: {len(kept)} files, {(args.out / NIXL_ARCHIVE).stat().st_size / 2**20:.1f} MiB packed)")
    if size > LIMIT_BYTES:
        print(f"over the {LIMIT_BYTES // 2**20} MiB limit", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
