"""This machine's CPU profile for ``--layout auto``: measured at the first start, kept, reused.

A profile fitted on another processor predicts that processor's goodput (issue 59: the stored
EPYC profile predicted 3.15 req/s where an Intel Xeon served 1.4), so ``--layout auto`` fits one
here. The fit is ``pdserve profile``'s (planner/profile.py), on the default model whatever is
served (the profile is the core's rates; the cost model applies them to the served model's
shape, as it does a stored profile's), on a shorter sweep
(``profile.CALIBRATION``: three prompt lengths and decode batches 8 down to 1 at two contexts,
timed on the measuring thread's CPU time so that a busy machine's other work does not count;
12 s of CPU, 16 s of wall time on this project's shared two-core box), in a child process
(``python -m pdserve.planner.calibration``): the engine it loads, the kernel path it pins and
the thread count it sets stay out of ``pdserve serve``'s own process, and a measurement that
hangs is cut at ``MEASURE_TIMEOUT_S``.

The result is cached as a profile JSON in the profile directory (``profile_dir``:
``$PDSERVE_PROFILE_DIR``, else ``$PDSERVE_CACHE_DIR/profiles`` as the kernels' build cache
sits beside it, else ``$XDG_CACHE_HOME/pdserve/profiles``, else ``~/.cache/pdserve/profiles``),
under a name that holds a digest of everything the measurement depends on (``CacheKey``): the
processor's model name, the kernel path, the serving dtype, pdserve's version, a hash of the
kernels' sources and flags, and ``CALIBRATION_VERSION`` (the sweep and fit). Any of them
changing names another file, so a new processor, path, build or pdserve measures again; an
unreadable cached file is measured over.

Where measuring is impossible the stored profile of the kernel path stays
(``auto_layout.profile_for``), and the log says why: no kernel path (a processor without AVX2 +
FMA runs torch's kernels, which no profile describes better than the stored one), the child
failing (the model does not load, the kernels do not compile) or running past the timeout, or
``PDSERVE_LAYOUT_MEASURE=0`` (never measure; the tests set it, so no test pays a measurement).
A profile directory that cannot be written does not stop the measurement: the profile is used
for this start and measured again at the next, said so.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Callable, Mapping

from pdserve.planner.hardware import HardwareProfile, ProfileError

# Raise when the sweep, the fit or what they measure changes (2: the KV block laid out layer-major,
# which makes decode attention cheaper): every cached profile is then measured again.
CALIBRATION_VERSION = 2
PROFILE_DIR_ENV = "PDSERVE_PROFILE_DIR"
MEASURE_ENV = "PDSERVE_LAYOUT_MEASURE"  # "0": never measure, simulate on the stored profile (the tests set it)
# A first start on a fresh machine compiles the kernels in the child too (about a minute on two
# cores; workers then find them built). Past this the stored profile is used.
MEASURE_TIMEOUT_S = 600.0


class CalibrationError(RuntimeError):
    """The measurement could not be made; the message says why (for the log)."""


@dataclass(frozen=True)
class CacheKey:
    """What a measured profile depends on: a change in any names another cache file."""

    processor: str  # /proc/cpuinfo's model name
    kernel_path: str  # the path the child pins (``PDSERVE_CPU_ISA``)
    dtype: str  # the serving dtype measured
    version: str  # pdserve's
    kernels: str  # ``kernel_source_hash()``
    calibration: int = CALIBRATION_VERSION

    def file_name(self) -> str:
        """``cpu-<path>-<dtype>-<digest>.json``: readable where it can be, unique by the digest."""
        digest = hashlib.blake2b("\0".join(map(str, astuple(self))).encode(), digest_size=8).hexdigest()
        return f"cpu-{self.kernel_path}-{self.dtype}-{digest}.json"


@dataclass(frozen=True)
class Resolved:
    """The profile ``--layout auto`` simulates on, where it came from, and why (for the log)."""

    profile: HardwareProfile
    file: Path
    how: str  # "measured now", "cached" or "stored"
    note: str = ""  # why the stored one (or why a measured one was not kept)

    def line(self) -> str:
        return f"profile {self.file} ({self.how}{'; ' + self.note if self.note else ''})"


def kernel_source_hash() -> str:
    """A digest of the CPU kernels' sources and compile flags (not their path, unlike the build
    cache's: two checkouts of the same sources measure the same)."""
    from pdserve.engine.kernels import cpu_kernels

    digest = hashlib.blake2b(digest_size=8)
    for src in sorted([*cpu_kernels.CSRC.glob("*.cpp"), *cpu_kernels.CSRC.glob("*.h")]):
        digest.update(src.name.encode())
        digest.update(src.read_bytes())
    digest.update(" ".join(cpu_kernels.CFLAGS).encode())
    return digest.hexdigest()


def cache_key(kernel_path: str, dtype: str | None) -> CacheKey:
    """This machine's key for ``kernel_path`` and the serving ``dtype`` (None: the default, bfloat16)."""
    from importlib.metadata import PackageNotFoundError, version

    from pdserve.engine.kernels.cpu_kernels import cpu_model

    try:
        installed = version("pdserve")
    except PackageNotFoundError:  # a checkout never installed: the kernels' hash still tells builds apart
        installed = "unknown"
    return CacheKey(cpu_model(), kernel_path, dtype or "bfloat16", installed, kernel_source_hash())


def profile_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """Where measured profiles are kept (module docstring: the variables, in order)."""
    if environ.get(PROFILE_DIR_ENV):
        return Path(environ[PROFILE_DIR_ENV])
    if environ.get("PDSERVE_CACHE_DIR"):
        return Path(environ["PDSERVE_CACHE_DIR"]) / "profiles"
    base = Path(environ["XDG_CACHE_HOME"]) if environ.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "pdserve" / "profiles"


# (key, file to write) -> None; raises CalibrationError
Measure = Callable[[CacheKey, Path], None]


def measure_in_child(key: CacheKey, out: Path, timeout_s: float = MEASURE_TIMEOUT_S) -> None:
    """Fit this machine's profile in a child process, written to ``out``."""
    env = {**os.environ, "PDSERVE_CPU_ISA": key.kernel_path}
    cmd = [sys.executable, "-m", "pdserve.planner.calibration", "--output", str(out), "--dtype", key.dtype]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise CalibrationError(f"measuring took over {timeout_s:g} s") from exc
    except OSError as exc:  # the interpreter could not be started
        raise CalibrationError(f"measuring could not start ({exc})") from exc
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise CalibrationError(f"measuring failed (exit {done.returncode}: {tail})")


def resolve(kernel_path: str | None, dtype: str | None, stored: Callable[[str | None], Path],
            directory: Path | None = None, measure: Measure | None = None,
            announce: Callable[[str], None] = lambda line: None,
            environ: Mapping[str, str] = os.environ) -> Resolved:
    """The profile for ``kernel_path`` and ``dtype``: the cached measurement of this machine, else
    one measured now (``measure``, default ``measure_in_child``; then cached), else the stored one
    (``stored(kernel_path)``'s file). ``announce`` hears that a measurement starts, before it
    does (it takes seconds)."""
    if kernel_path is None:
        return _stored(stored(None), "no kernel path on this processor (it lacks AVX2 + FMA), so nothing to measure")
    if environ.get(MEASURE_ENV, "").strip() == "0":
        return _stored(stored(kernel_path), f"{MEASURE_ENV}=0: this machine is not measured")
    key = cache_key(kernel_path, dtype)
    file = (directory or profile_dir(environ)) / key.file_name()
    note = ""
    if file.exists():
        try:
            return Resolved(HardwareProfile.load(file), file, "cached")
        except (ProfileError, TypeError) as exc:
            note = f"the cached file was unreadable ({exc}); measured again"
    announce(f"measuring this machine ({key.processor}, kernel path {kernel_path}, {key.dtype}) for the layout "
             f"choice: once per processor, kernel path and build, about 15 s")
    if _writable(file.parent):
        target, kept = file, True
    else:
        target, kept = _scratch(key), False
        note = f"not cached: {file.parent} cannot be written, so the next start measures again"
    busy = _busy()
    try:
        (measure or measure_in_child)(key, target)
        note = "; ".join(n for n in (note, busy and f"{busy}: delete the file to measure again") if n)
        return Resolved(HardwareProfile.load(target), target if kept else file, "measured now", note)
    except (CalibrationError, ProfileError) as exc:
        return _stored(stored(kernel_path), f"{exc}")
    finally:
        if not kept:
            target.unlink(missing_ok=True)


def _busy() -> str:
    """What the log should know of other work on this machine's cores ("" when quiet). The
    measurement is timed on its thread's CPU time, so other processes' time slices cost it
    nothing (at a load average of 4.3: 212 GFLOP/s of matmuls and 23.5 GB/s, where the stored
    profile of this EPYC, taken quiet on wall time, has 204 and 29; on wall time at 14.7 it read
    100 and 7.9), but memory bandwidth and caches are still shared."""
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    return (f"measured while busy (load average {load:.1f} on {cores} cores: timed on CPU time, but memory "
            f"bandwidth was shared)") if load >= cores else ""


def _writable(directory: Path) -> bool:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(directory, os.W_OK)


def _stored(file: Path, why: str) -> Resolved:
    return Resolved(HardwareProfile.load(file), file, "stored", why)


def _scratch(key: CacheKey) -> Path:
    import tempfile

    return Path(tempfile.gettempdir()) / f"pdserve-{os.getpid()}-{key.file_name()}"


def main(argv: list[str] | None = None) -> int:
    """The child: fit the profile with ``profile.CALIBRATION`` and write it to ``--output``
    (through a file beside it, so a reader never finds half of one)."""
    import argparse

    from pdserve.engine.kernels.cpu_kernels import cpu_model, default_isa
    from pdserve.planner.profile import CALIBRATION, profile_engine

    parser = argparse.ArgumentParser(prog="python -m pdserve.planner.calibration")
    parser.add_argument("--output", required=True)
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16"))
    args = parser.parse_args(argv)
    profile, _, _ = profile_engine("default", args.dtype, threads=1, sweep=CALIBRATION, progress=False,
                                   label=f"measured by --layout auto on {cpu_model()}, kernel path {default_isa()}")
    out = Path(args.output)
    tmp = out.with_name(f".{out.name}.{os.getpid()}")
    profile.save(tmp)
    os.replace(tmp, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
