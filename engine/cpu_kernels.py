"""pdserve's own CPU kernels (``engine/csrc/*.cpp``), compiled once per machine, cached on disk.

Every source registers its operators with ``TORCH_LIBRARY_FRAGMENT(pdserve, m)``; once
``load()`` has run they are ``torch.ops.pdserve.<name>``, callable from eager code and from
``torch.compile``d graphs alike.

The sources are compiled for AVX2 + FMA, never ``-march=native``: a machine with AVX-512 or
AMX runs the very same instructions as one without, so a kernel's bits do not depend on
which x86 machine the tests or the cluster happen to land on. The build is cached under
``$PDSERVE_CACHE_DIR/kernels`` (default ``~/.cache/pdserve/kernels``), keyed by the sources'
hash, so only the first start on a machine pays for the compile (with a progress line).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
# Flags are part of the numerics: FMA contraction is explicit in the sources (intrinsics),
# and -ffp-contract=off stops the compiler from fusing the scalar tails differently.
# -fopenmp makes at::parallel_for in the kernels run on torch's threads: without it ATen's
# header compiles the loop serially, and two threads ran a 512-row linear no faster than one.
# It changes no result: the kernels divide work between threads only where no sum is split.
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fno-fast-math", "-std=c++17", "-fopenmp"]
LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_loaded = False


def sources() -> list[Path]:
    return sorted(CSRC.glob("*.cpp"))


def cache_dir() -> Path:
    root = Path(os.environ.get("PDSERVE_CACHE_DIR", Path.home() / ".cache" / "pdserve"))
    digest = hashlib.blake2b(digest_size=8)
    # The build files name the sources by path: two checkouts of the same sources sharing one
    # directory would rewrite them in turn, and every worker start would compile again.
    digest.update(str(CSRC.resolve()).encode())
    for src in sources() + sorted(CSRC.glob("*.h")):
        digest.update(src.name.encode())
        digest.update(src.read_bytes())
    digest.update(" ".join(CFLAGS).encode())
    return root / "kernels" / digest.hexdigest()


def cpu_supported() -> bool:
    """True on an x86-64 CPU with AVX2 and FMA (what the kernels are compiled for)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx2" in flags and " fma" in flags


def load() -> None:
    """Compile (first time on this machine) and load every kernel; safe to call repeatedly."""
    global _loaded
    with _lock:
        if _loaded:
            return
        from torch.utils.cpp_extension import load as build

        srcs = [str(s) for s in sources()]
        if not srcs:
            _loaded = True
            return
        out = cache_dir()
        out.mkdir(parents=True, exist_ok=True)
        _clear_stale_build_lock(out)
        log.info("loading pdserve CPU kernels from %s (compiling on first use, about a minute)", out)
        build(name="pdserve_cpu_kernels", sources=srcs, extra_cflags=CFLAGS, extra_ldflags=LDFLAGS,
              build_directory=str(out), is_python_module=False, verbose=False)
        _loaded = True


STALE_LOCK_S = 600.0  # a compile takes about a minute; a lock this old outlived its process


def _clear_stale_build_lock(out: Path) -> None:
    """torch's extension builder holds ``out/lock`` while one process compiles and makes the
    others wait for it. A compile that was killed leaves the file behind, and every later
    start would wait forever: a lock older than any compile is removed."""
    lock = out / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        log.warning("removing a stale kernel build lock %s (%.0f s old: its compile was killed)", lock, age)
        lock.unlink(missing_ok=True)
