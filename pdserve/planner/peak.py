"""One core's peak FLOP/s on each kernel path: what the prefill GEMMs are measured against.

    peak = FMA instructions a cycle x float32 lanes a vector x products an FMA lane makes x 2 x clock

- Lanes: 8 on the ``avx2`` path (256-bit vectors), 16 on the AVX-512 paths.
- FMA instructions a cycle, at that width, from the vendor and the flags (/proc/cpuinfo tells
  no unit count): Intel cores with AVX-512 issue two 512-bit FMAs a cycle (ports 0 and 5; Xeon
  Gold and Platinum, where Silver and Bronze have one, which the flags do not show) and two
  256-bit ones; AMD Zen 4 (AVX-512 without ``avx512_vp2intersect``) has two 256-bit FMA pipes
  and runs a 512-bit FMA on both, so one a cycle; Zen 5 two 512-bit ones.
- Products a lane: 1 for an FMA; 2 for ``VDPBF16PS`` (the ``avx512_bf16`` path on bfloat16
  weights: a pair of bfloat16 products summed into each float32 lane, at the FMA's rate on Zen
  4, and taken as the same on Intel, where it is not always so: on the AMX Xeon of BENCHMARKS.md
  float32 FMAs outran its bfloat16 dot products, so this path's share of peak reads low there).
  The ``avx2`` and ``avx512`` paths widen bfloat16 to float32 and run FMAs, so their bfloat16
  peak is their float32 peak; float32 weights take the FMA chain on every path.
- ``amx``: one TMUL a core, a 16 x 32 x 16 bfloat16 tile product (16,384 FLOPs) each 16 cycles:
  1,024 FLOPs a cycle.
- The clock: measured (``measure_clock_hz``), as a chain of dependent register-to-register
  integer adds (one cycle of latency on every x86-64 core since the Pentium 4's successors),
  timed at its fastest of several runs. Not adds of an immediate: Intel's newer renamers fold
  a chain of those (on the AMX Xeon of BENCHMARKS.md, 64 of them ran at "22 GHz", where the
  register adds and an ``imul`` chain, 3 cycles a link, both read 3.7 GHz). Under a
  hypervisor /proc/cpuinfo's "cpu MHz" is the nominal clock (2.6 GHz on this project's EPYC,
  which runs its cores at up to 3.7), and a boost clock is what the kernels run at. Without a
  C compiler the /proc/cpuinfo figure is used, said so.
"""

from __future__ import annotations

import ctypes
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

AMX_FLOPS_PER_CYCLE = 1024
_ADDS_PER_ITERATION = 64
_CLOCK_SOURCE = r"""
#include <time.h>
#define A "add %1, %0\n\t"
#define A8 A A A A A A A A
double pdserve_add_chain_s(long iterations) {  /* iterations x 64 dependent adds */
  struct timespec a, b;
  unsigned long x = 0, one = 1;  /* a register operand: a chain of immediate adds can be folded */
  clock_gettime(CLOCK_MONOTONIC, &a);
  for (long i = 0; i < iterations; i++) __asm__ volatile(A8 A8 A8 A8 A8 A8 A8 A8 : "+r"(x) : "r"(one));
  clock_gettime(CLOCK_MONOTONIC, &b);
  return (b.tv_sec - a.tv_sec) + 1e-9 * (b.tv_nsec - a.tv_nsec) + 0.0 * x;
}
"""


@dataclass(frozen=True)
class Clock:
    hz: float
    how: str  # how it was found, for the table's header


@dataclass(frozen=True)
class Core:
    """What ``peak_flops`` needs of the processor: its vendor, flags and clock."""

    vendor: str  # /proc/cpuinfo's vendor_id: "GenuineIntel", "AuthenticAMD"
    flags: frozenset[str]
    clock: Clock

    def fma_per_cycle(self, lanes: int) -> int:
        """FMA instructions a cycle at ``lanes`` float32 lanes (module docstring)."""
        if lanes == 8:
            return 2
        zen4 = self.vendor == "AuthenticAMD" and "avx512_vp2intersect" not in self.flags
        return 1 if zen4 else 2

    def peak_flops(self, path: str, dtype: str) -> float:
        """One core's peak FLOP/s on kernel path ``path`` with ``dtype`` ("bfloat16" or "float32") weights."""
        if path == "amx" and dtype == "bfloat16":
            return AMX_FLOPS_PER_CYCLE * self.clock.hz
        lanes = 8 if path == "avx2" else 16
        products = 2 if path in ("avx512_bf16", "amx") and dtype == "bfloat16" else 1
        return self.fma_per_cycle(lanes) * lanes * products * 2 * self.clock.hz

    def describe(self, path: str, dtype: str) -> str:
        """The peak's terms, as the table's notes spell them."""
        if path == "amx" and dtype == "bfloat16":
            return f"{AMX_FLOPS_PER_CYCLE} FLOP/cycle (one TMUL)"
        lanes = 8 if path == "avx2" else 16
        products = 2 if path in ("avx512_bf16", "amx") and dtype == "bfloat16" else 1
        return (f"{self.fma_per_cycle(lanes)} FMA/cycle x {lanes} lanes x {products} product(s) x 2 = "
                f"{self.fma_per_cycle(lanes) * lanes * products * 2} FLOP/cycle")


def this_core(cpuinfo: str | None = None) -> Core:
    """This processor's ``Core``: vendor and flags from /proc/cpuinfo, the clock measured."""
    text = cpuinfo if cpuinfo is not None else Path("/proc/cpuinfo").read_text()
    fields = _first_fields(text)
    return Core(fields.get("vendor_id", "unknown"), frozenset(fields.get("flags", "").split()),
                measure_clock_hz(fields))


def measure_clock_hz(fields: dict[str, str] | None = None, runs: int = 100, adds: int = 500_000) -> Clock:
    """The core's clock: ``adds`` dependent adds (0.14 ms at 3.7 GHz), the fastest of ``runs``;
    /proc/cpuinfo's "cpu MHz" where no C compiler builds the loop. Short runs, many of them: at a
    load average of 14 on two cores, runs of 20 million adds were all cut by other processes
    (0.7 GHz, the fastest of nine), where runs of half a million gave 3.69 GHz, the fastest of 30 or 100."""
    try:
        chain = _add_chain()
    except (OSError, subprocess.CalledProcessError) as exc:
        mhz = float((fields or _first_fields(Path("/proc/cpuinfo").read_text())).get("cpu MHz", "nan"))
        return Clock(mhz * 1e6, f"/proc/cpuinfo's cpu MHz (no C compiler for the add chain: {exc})")
    iterations = adds // _ADDS_PER_ITERATION
    chain(iterations // 10)  # wake the core from a low clock
    best = min(chain(iterations) for _ in range(runs))
    return Clock(iterations * _ADDS_PER_ITERATION / best,
                 f"measured: {iterations * _ADDS_PER_ITERATION:,} dependent adds, fastest of {runs}")


def _add_chain():
    """The add chain compiled with the system's C compiler into a temporary library (some 50 ms)."""
    with tempfile.TemporaryDirectory(prefix="pdserve-clock-") as tmp:
        src, lib = Path(tmp) / "clock.c", Path(tmp) / "clock.so"
        src.write_text(_CLOCK_SOURCE)
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, capture_output=True)
        fn = ctypes.CDLL(str(lib)).pdserve_add_chain_s  # loaded before the file goes: the mapping stays
    fn.restype, fn.argtypes = ctypes.c_double, [ctypes.c_long]
    return fn


def _first_fields(cpuinfo: str) -> dict[str, str]:
    """The first processor's ``key: value`` lines of /proc/cpuinfo."""
    out: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if out:
                break
            continue
        key, _, value = line.partition(":")
        out.setdefault(key.strip(), value.strip())
    return out


def timed(op, repeats: int, clock=time.thread_time) -> float:
    """The fastest of ``repeats`` runs of ``op`` after one untimed, on ``clock``: by default the
    calling thread's CPU time, which a single-threaded kernel runs on (one torch thread, no
    borrowed cores), so the time slices other processes take on a shared machine are not
    counted. On wall time, at a load average of 20 on two cores, every GEMM longer than some
    5 ms was cut: the same kernel ran the 256-token o projection at 94% of peak and the
    1,024-token one at 39%."""
    op()
    best = float("inf")
    for _ in range(repeats):
        t = clock()
        op()
        best = min(best, clock() - t)
    return best
