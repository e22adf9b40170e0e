"""The decode step's profile (issue 56): which kernels a step runs and where its time goes.

``profile_row`` runs a few decode steps of a batch already running in the engine under
``torch.profiler`` and sums what the device did by kernel class (``kernel_class``: the
linears, attention, the KV store, norms, RoPE, activations, copies, the rest): kernels a step,
device time a step per class, and the busiest kernels by name. Set against the step's wall
time, the device's summed busy time says how much of the step is kernels and how much is gaps
between them (launches, or a graph's node-to-node overhead). On CUDA the profiler sees the
kernels inside a CUDA graph's replay too (CUPTI traces graph nodes), so the graphed step is
profiled as it runs; where it sees only the replay itself, ``kernels_per_step`` says so (about
one). On the CPU (the dry run) the same code sums torch's operators instead of kernels.
"""

from __future__ import annotations

import re
import time

import torch

# First match wins: the order matters (a fused norm kernel's name holds "rms", a GEMM's "gemm").
CLASSES = (
    ("attention", re.compile(r"attention|attn|flash|decode_split|split_kv|reduce_splits", re.I)),
    ("kv_store", re.compile(r"store_kv|reshape_and_cache", re.I)),
    ("linear", re.compile(r"gemm|gemv|cutlass|nvjet|xmma|cublas|scaled_mm|aten::(mm|addmm|linear|matmul)$|pdserve::linear|splitk", re.I)),
    ("norm", re.compile(r"rms|norm|rsqrt|aten::(mean|pow)$|reduce_kernel", re.I)),
    ("rope", re.compile(r"rotary|rope", re.I)),
    ("activation", re.compile(r"silu|gelu|act_and_mul", re.I)),
    ("copy", re.compile(r"copy|memcpy|memset|cat|index|gather|scatter|fill", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|aten::(mul|add|neg|sub|div|exp)$", re.I)),
)
TOP = 12  # kernels listed by name


def kernel_class(name: str) -> str:
    for label, pattern in CLASSES:
        if pattern.search(name):
            return label
    return "other"


def _device_us(event, cuda: bool) -> float:
    """An averaged event's own time on the device (CUDA) or the host (CPU), microseconds; torch's
    attribute names moved between versions."""
    names = ("self_device_time_total", "self_cuda_time_total") if cuda else ("self_cpu_time_total",)
    for name in names:
        value = getattr(event, name, None)
        if value is not None:
            return float(value)
    return 0.0


def _is_kernel(event, cuda: bool) -> bool:
    if not cuda:
        return event.key.startswith(("aten::", "pdserve::"))
    device_type = getattr(event, "device_type", None)
    return device_type is not None and "CUDA" in str(device_type) and _device_us(event, cuda) > 0


def profile_row(engine, device, steps: int, batch: int, context: int, step_ms: float, floor_ms: float | None) -> dict:
    """Profile ``steps`` engine steps of the decode batch the caller started (``batch``
    sequences of ``context`` tokens, timed at ``step_ms`` a step) and summarise them."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        if cuda:
            torch.cuda.synchronize(device)
        wall_ms = (time.perf_counter() - start) / steps * 1e3
    kernels = [e for e in prof.key_averages() if _is_kernel(e, cuda)]
    by_class: dict[str, float] = {}
    count = 0
    for e in kernels:
        label = kernel_class(e.key)
        by_class[label] = by_class.get(label, 0.0) + _device_us(e, cuda) / steps / 1e3
        count += e.count
    busy_ms = sum(by_class.values())
    top = sorted(kernels, key=lambda e: _device_us(e, cuda), reverse=True)[:TOP]
    row = {"what": "step_profile", "batch": batch, "context": context,
           "cuda_graphs": bool(engine.config.cuda_graphs), "steps": steps,
           "kernels_per_step": round(count / steps, 1),
           "step_ms": round(step_ms, 3), "profiled_step_ms": round(wall_ms, 3),
           "device_busy_ms": round(busy_ms, 3),
           "ms_by_class": {k: round(v, 3) for k, v in sorted(by_class.items(), key=lambda kv: -kv[1])},
           "top_kernels": [{"name": e.key[:120], "class": kernel_class(e.key), "calls_per_step": round(e.count / steps, 1),
                            "ms_per_step": round(_device_us(e, cuda) / steps / 1e3, 4)} for e in top]}
    if floor_ms:
        row["floor_ms"] = floor_ms
        row["busy_over_floor"] = round(busy_ms / floor_ms, 2)
    row["kernels_per_layer"] = round(count / steps / engine.model_cfg.num_layers, 1)
    return row
