"""pdserve's own CPU kernels (``pdserve/engine/kernels/csrc/*.cpp``), compiled once per machine, cached on disk.

Every source registers its operators with ``TORCH_LIBRARY_FRAGMENT(pdserve, m)``; once
``load()`` has run they are ``torch.ops.pdserve.<name>``, callable from eager code and from
``torch.compile``d graphs alike.

Kernel paths. One build holds every instruction-set path of the linears (AVX2 + FMA,
AVX-512, AVX-512 BF16, AMX; pdserve/engine/kernels/csrc/isa.h): the baseline flags are AVX2 + FMA, never
``-march=native``, and the wider paths are compiled per function (``#pragma GCC target``), so
the same cached build runs on any x86-64 machine with AVX2. ``load()`` then fixes the path
for the process: the fastest one the processor runs, or the one ``PDSERVE_CPU_ISA`` names
(``avx2``, ``avx512``, ``avx512_bf16``, ``amx``; one the processor lacks is an error). Each
path is batch-invariant on its own; bits are the same across processors only on the AVX2
and AVX-512 paths (bfloat16 pairs round differently from single FMAs), and float32 weights
always take the FMA chain. The attention, norm and RoPE kernels are AVX2 on every path.

The build is cached under ``$PDSERVE_CACHE_DIR/kernels`` (default ``~/.cache/pdserve/kernels``),
keyed by the sources' hash, so only the first start on a machine pays for the compile.
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
_default = "avx2"


def sources() -> list[Path]:
    return sorted(CSRC.glob("*.cpp"))


# The sources that include torch's headers are compiled as one translation unit: each parsed
# ATen and torch/library.h on its own, some 9 s of a compiler's time before its own code (7 of
# them: ~72 s on 2 cores, one ~16 s unit), and that parse was most of the first start's
# compile. The same flags, so the same numerics: without contraction or fast-math nothing the
# compiler may do across them (inlining) changes a float result. The others (intrinsics only)
# compile on their own, beside it. A file-scope ``using namespace`` reaches the sources after it
# here (paged_attention.cpp's is last in name order; its header paged_attention_worker.h comes with it).
UNITY = "torch_sources.cpp"


def _includes_torch(src: Path) -> bool:
    return any(f"#include <{h}" in src.read_text() for h in ("ATen/", "torch/", "c10/"))


def build_sources(out: Path) -> list[str]:
    """What the build compiles: one unit that includes every source using torch's headers
    (written to ``out`` only when it changes, so ninja finds it up to date), then the rest."""
    heavy = [s for s in sources() if _includes_torch(s)]
    text = "".join(f'#include "{s}"\n' for s in heavy)
    unity = out / UNITY
    if not unity.exists() or unity.read_text() != text:
        tmp = out / f"{UNITY}.{os.getpid()}"  # workers start side by side: none reads half a file
        tmp.write_text(text)
        os.replace(tmp, unity)
    return [str(unity)] + [str(s) for s in sources() if s not in heavy]


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
    digest.update(UNITY.encode())  # a build of one object per source is not this one
    return root / "kernels" / digest.hexdigest()


def cpu_supported() -> bool:
    """True on an x86-64 CPU with AVX2 and FMA (what the kernels are compiled for)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx2" in flags and " fma" in flags


ISA_ENV = "PDSERVE_CPU_ISA"
ISAS = ("avx2", "avx512", "avx512_bf16", "amx")  # slowest first


class KernelPathError(ValueError):
    """``PDSERVE_CPU_ISA`` names a path this processor cannot run, or no path at all."""


def requested_isa() -> str | None:
    """The path ``PDSERVE_CPU_ISA`` pins (checked against the known names), or None for the best."""
    name = os.environ.get(ISA_ENV, "").strip().lower()
    if not name or name == "auto":
        return None
    if name not in ISAS:
        raise KernelPathError(f"{ISA_ENV}={name!r} is not a kernel path: expected one of {', '.join(ISAS)} or auto")
    return name


# What /proc/cpuinfo must list for each path (the kernels check CPUID itself at load).
ISA_FLAGS = {"avx2": ("avx2", "fma"), "avx512": ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"),
             "avx512_bf16": ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"),
             "amx": ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "amx_tile",
                     "amx_bf16")}


def check_requested_isa(cpuinfo: str | None = None) -> None:
    """Before anything starts (``pdserve serve``, ``pdserve worker``): a ``PDSERVE_CPU_ISA`` that
    names no path, or a path this processor lacks, is a ``KernelPathError`` naming what it has;
    no kernels are compiled for the check. ``cpuinfo``: /proc/cpuinfo's text (read if None)."""
    wanted = requested_isa()
    if wanted is None:
        return
    have = _flags(cpuinfo)
    if have is None:
        return  # not Linux: the workers' own check at load still applies
    runs = [name for name in ISAS if set(ISA_FLAGS[name]) <= have]
    if wanted not in runs:
        missing = sorted(set(ISA_FLAGS[wanted]) - have)
        raise KernelPathError(f"{ISA_ENV}={wanted} but this processor ({cpu_model()}) lacks {', '.join(missing)}; "
                              f"it runs {', '.join(runs) or 'none of the kernel paths'}")


def runnable_isas() -> list[str]:
    """The paths this processor and OS can run, slowest first (after ``load()``)."""
    load()
    return list(torch_ops().cpu_isas())


def isa() -> str:
    """The path in force in this process (after ``load()``)."""
    load()
    return torch_ops().get_isa()


def set_isa(name: str) -> None:
    """Fix the kernel path; weights packed before must be packed again (tests switch paths)."""
    load()
    torch_ops().set_isa(name)


def is_loaded() -> bool:
    """Whether ``load`` has run in this process (its operators are then registered)."""
    return _loaded and bool(sources())


def torch_ops():
    import torch

    return torch.ops.pdserve


def load() -> None:
    """Compile (first time on this machine) and load every kernel, then fix the kernel path
    (``PDSERVE_CPU_ISA`` or the best one here); safe to call repeatedly."""
    global _loaded
    with _lock:
        if _loaded:
            return
        wanted = requested_isa()
        from torch.utils.cpp_extension import load as build

        if not sources():
            _loaded = True
            return
        out = cache_dir()
        out.mkdir(parents=True, exist_ok=True)
        _clear_stale_build_lock(out)
        srcs = build_sources(out)
        log.info("loading pdserve CPU kernels from %s (compiling on first use, under a minute)", out)
        build(name="pdserve_cpu_kernels", sources=srcs, extra_cflags=CFLAGS, extra_ldflags=LDFLAGS,
              build_directory=str(out), is_python_module=False, verbose=False)
        global _default
        _default = choose_isa(wanted, list(torch_ops().cpu_isas()))
        torch_ops().set_isa(_default)
        log.info("CPU kernel path %s on %s", _default, cpu_model())
        _loaded = True


def choose_isa(wanted: str | None, runs: list[str]) -> str:
    """The path to use: ``wanted`` if this processor runs it (an error naming what it runs if
    not), else the fastest of ``runs`` (slowest first)."""
    if not runs:
        raise KernelPathError(f"this processor ({cpu_model()}) runs none of pdserve's kernel paths: "
                              "they need AVX2 + FMA")
    if wanted is not None and wanted not in runs:
        raise KernelPathError(f"{ISA_ENV}={wanted} but this processor ({cpu_model()}) runs only "
                              f"{', '.join(runs)}")
    return wanted or runs[-1]


def default_isa() -> str:
    """The path ``load()`` chose for this process (``PDSERVE_CPU_ISA``, or the fastest here)."""
    load()
    return _default


def cpu_model() -> str:
    """The processor's model name from /proc/cpuinfo (for logs and benchmark headers)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown processor"


def cpu_flags() -> list[str]:
    """The instruction-set flags that pick a kernel path, as /proc/cpuinfo names them."""
    have = _flags() or set()
    return [f for f in ISA_FLAGS["amx"] if f in have]


def _flags(cpuinfo: str | None = None) -> set[str] | None:
    """The first ``flags`` line of /proc/cpuinfo (or of ``cpuinfo``), None where there is none to read."""
    try:
        text = cpuinfo if cpuinfo is not None else Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    return set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))


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
