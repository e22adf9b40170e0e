"""What every benchmark prints first, and records with its results: the processor, its
instruction-set flags, and the kernel path pdserve runs on it (pdserve/engine/kernels/cpu_kernels.py). The
processor behind a machine of this project changes from day to day (AVX2 only, AVX-512 BF16,
AMX), and a figure means nothing without it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pdserve.engine.kernels import cpu_kernels# noqa: E402


def describe() -> dict:
    """{cpu_model, cpus, flags, kernel_path, runnable_paths, onednn_max_isa} of this machine and
    process. ``onednn_max_isa`` is ``ONEDNN_MAX_CPU_ISA`` when set (None otherwise): with
    ``PDSERVE_CPU_ISA`` it stands in for a processor with fewer instructions, and a figure taken
    so must say it is an emulation."""
    supported = cpu_kernels.cpu_supported()
    return {"cpu_model": cpu_kernels.cpu_model(), "cpus": os.cpu_count(), "flags": cpu_kernels.cpu_flags(),
            "kernel_path": cpu_kernels.isa() if supported else None,
            "runnable_paths": cpu_kernels.runnable_isas() if supported else [],
            "onednn_max_isa": os.environ.get("ONEDNN_MAX_CPU_ISA")}


def banner(info: dict | None = None) -> str:
    info = info or describe()
    return (f"processor: {info['cpu_model']} ({info['cpus']} cpus) | flags: {' '.join(info['flags']) or 'none'} | "
            f"pdserve kernel path: {info['kernel_path'] or 'torch (no AVX2)'}"
            f" (this processor runs: {', '.join(info['runnable_paths']) or 'none'})"
            + (f" | oneDNN capped at {info['onednn_max_isa']}" if info.get("onednn_max_isa") else ""))


def print_banner() -> dict:
    info = describe()
    print(banner(info), flush=True)
    return info
