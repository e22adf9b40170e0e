"""Environment probe, part 1 of scripts/gpu_check.sh: what this host offers pdserve's CUDA
path, as one JSON object (also written to ``$GPU_CHECK_OUT/probe.json``). Exits 1 without
a CUDA device unless ``PDSERVE_CHECK_DEVICE=cpu`` (a dry run of the check elsewhere).

It reports: torch and the CUDA it was built for; the device, its capability and memory; the
driver (the CUDA version libcuda supports, and nvidia-smi's driver version where present);
flash-attn or not; for each NIXL wheel that fits this torch, whether its UCX CUDA transport
libraries resolve every library they link (``ldd``) and load; and the attention backend
``auto`` picks for bfloat16 and for float32.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch


def _driver() -> dict:
    out: dict = {}
    try:
        version = ctypes.c_int()
        ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version))
        out["cuda_driver_api"] = f"{version.value // 1000}.{version.value % 1000 // 10}"
    except OSError as exc:
        out["cuda_driver_api"] = f"libcuda not loadable: {exc}"
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        out["driver_version"] = smi.stdout.strip() or smi.stderr.strip()
    return out


def _flash_attn() -> str:
    try:
        import flash_attn
    except Exception as exc:  # absent, or built against another torch
        return f"absent ({type(exc).__name__}: {exc})"
    return flash_attn.__version__


def _ucx_cuda_libs(module: str) -> dict:
    """Whether ``module``'s bundled UCX CUDA transports find every library they link."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return {"installed": False}
    libs = sorted(glob.glob(str(Path(list(spec.submodule_search_locations)[0]).parent / f"{module}.libs" / "ucx"
                                / "libuct_cuda*.so*")))
    report: dict = {"installed": True, "libraries": {}}
    for lib in libs:
        missing = []
        if shutil.which("ldd"):
            ldd = subprocess.run(["ldd", lib], capture_output=True, text=True, timeout=30).stdout
            missing = [line.split()[0] for line in ldd.splitlines() if "not found" in line]
        try:
            ctypes.CDLL(lib)
            loads = "yes"
        except OSError as exc:
            loads = f"no: {exc}"
        report["libraries"][Path(lib).name] = {"missing": missing, "loads": loads}
    report["resolved"] = bool(libs) and all(not v["missing"] and v["loads"] == "yes"
                                            for v in report["libraries"].values())
    return report


def _nixl() -> dict:
    from pdserve.kv_transfer.nixl_backend import nixl_modules_for

    wanted = nixl_modules_for(torch.version.cuda)
    return {"fits_this_torch": list(wanted), **{m: _ucx_cuda_libs(m) for m in wanted}}


def _auto_backend(device: torch.device) -> dict:
    from pdserve.engine.attention.select import select_backend

    # SmolLM2-135M's heads: 9 query, 3 KV, 64 wide; the default block size.
    return {str(dtype).removeprefix("torch."): select_backend("auto", device, 9, 3, 64, 16, dtype=dtype).name
            for dtype in (torch.bfloat16, torch.float32)}


def probe() -> dict:
    cuda = torch.cuda.is_available()
    device = torch.device(os.environ.get("PDSERVE_CHECK_DEVICE", "cuda" if cuda else "cpu"))
    out = {"python": sys.version.split()[0], "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "cuda_available": cuda}
    if cuda:
        props = torch.cuda.get_device_properties(0)
        out.update(device=props.name, capability=f"{props.major}.{props.minor}",
                   memory_gib=round(props.total_memory / 2**30, 1), device_count=torch.cuda.device_count())
        out.update(_driver())
    out["flash_attn"] = _flash_attn()
    try:
        out["nixl"] = _nixl()
    except Exception as exc:  # the probe reports; it never stops at the first gap
        out["nixl"] = f"{type(exc).__name__}: {exc}"
    out["auto_attention_backend"] = _auto_backend(device)
    return out


def main() -> int:
    report = probe()
    text = json.dumps(report, indent=1)
    print(text)
    out = Path(os.environ.get("GPU_CHECK_OUT", "gpu_check_out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe.json").write_text(text + "\n")
    if not report["cuda_available"] and os.environ.get("PDSERVE_CHECK_DEVICE") != "cpu":
        print("no CUDA device: this check is for a CUDA host (PDSERVE_CHECK_DEVICE=cpu dry-runs it)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
