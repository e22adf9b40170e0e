"""Hardware profiles: what one device can do, as achievable (not peak) rates.

A GPU profile takes its peaks from the vendor's datasheet and multiplies them by an
efficiency factor; the factor and where it comes from are written next to each one. The CPU
profile is not derived from peaks: ``pdserve profile`` fits it to step times measured on our
own engine here, and writes it as JSON (``save`` / ``load``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path


class ProfileError(ValueError):
    """A profile name or file is unknown or malformed; ``field`` names the offending value."""

    def __init__(self, field: str, problem: str):
        self.field = field
        super().__init__(f"{field}: {problem}")


# A KV tier load's rate on this machine (``profile.tier_load_bandwidth``: 256 of SmolLM2's
# 368,640-byte blocks from files under /tmp, page cache warm, read + XXH3-64 + copy into a cache
# row; the fastest of 5 passes): 4.3 GB/s, the median of 5 such probes at load average 8 on the 2
# cores (2.7-5.3); with the machine busier (load 14-18) 1.0-2.3 GB/s. A plain read of the same
# files: up to 5-6 GB/s.
KV_TIER_LOAD_BW = 4.3e9


@dataclass(frozen=True)
class HardwareProfile:
    """One device (a GPU, or one CPU core running one worker)."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s (CPU: the fitted achievable rate, efficiency 1)
    flops_efficiency: float  # share of peak a prefill GEMM reaches (MFU)
    peak_mem_bw: float  # bytes/s of device memory
    mem_bw_efficiency: float  # share of peak a decode step's weight + KV reads reach (MBU)
    mem_bytes: float  # device memory, weights + KV cache
    kv_link_bw: float  # bytes/s for KV between a prefill and a decode worker
    kv_transfer_overhead_s: float  # fixed cost per transfer (handshake, registration, RPC)
    interconnect_bw: float  # bytes/s between GPUs of one tensor-parallel group within a node (NVLink)
    step_overhead_s: float  # fixed cost of one engine step (launches, scheduling, sampling)
    # Cost per sequence in a step beyond its FLOPs and bytes: 0 on GPUs (one batched kernel);
    # on CPU the engine's per-sequence work (attention calls per context length, sampling) shows here.
    seq_overhead_s: float = 0.0
    # True where compute and memory traffic overlap (a GPU's decode step takes the longer of
    # the two); False on one CPU core, where the same core does both, so they add.
    overlap: bool = True
    dtype_bytes: int = 2
    source: str = ""
    # Devices one node holds (an HGX/DGX board: 8). A tensor-parallel group wider than this
    # spans nodes, and its all-reduces cross the nodes' NICs (``kv_link_bw`` per device).
    devices_per_node: int = 8
    # Achievable FLOP/s of attention, where it differs from the matmuls' (``flops``): None on
    # the GPU profiles, where attention runs at the matmuls' rate in prefill and decode
    # attention is paid through its KV bytes. The CPU fit measures both: a prefill's causal
    # attention and a decode step's attention over the cached context run other kernels than
    # the linears, at a fraction of their rate (decode: about 4 us per context token here,
    # several times what its KV bytes alone would cost).
    prefill_attention_flops: float | None = None
    decode_attention_flops: float | None = None
    # The decode steps the CPU fit was made from, [[batch, context per sequence, seconds], ...],
    # and the shape of the model they ran (``ModelSpec.shape``: layers, hidden, heads, KV heads,
    # head dim, intermediate, vocab, MLP matrices). For that model the cost model corrects its formula by the measured
    # over fitted ratio at the nearest points: the engine's step is not linear in the batch
    # (its kernels cut a batch into row tiles), and the fit leaves up to 8% at some batches.
    decode_points: tuple = ()
    points_model: tuple = ()
    # What serving adds to each decode step beyond the engine's own (the worker's loop between
    # steps, streaming each token out): per step and per sequence in it. Measured through a
    # running cluster (``benchmarks/planner/calibrate.py --serving-cost``); 0 on the GPU
    # profiles, whose step overheads already stand for the whole served step.
    served_step_s: float = 0.0
    served_seq_s: float = 0.0
    # A served prefill step over the engine's own: the other worker busy on the other core
    # (they share memory bandwidth and the L3 cache), and the router between client and worker.
    served_prefill_factor: float = 1.0
    # A served decode step's engine time over the profile's, where a served run measured it
    # (``calibrate.py --step-trace``: the machine's speed during that run). 1 everywhere else.
    served_decode_factor: float = 1.0
    # A step's time when the host's other workers are idle and its kernels borrow their cores
    # (``--borrow-idle-cores``, on by default where ``pdserve serve`` pins workers), over its time
    # with them busy: the served probe measures both. 1 (no borrowing) on the GPU profiles.
    borrow_prefill_factor: float = 1.0
    borrow_decode_factor: float = 1.0
    # Bytes/s a KV tier load gives back (``--kv-offload-bytes``: prefix blocks read from the
    # host's tier directory, verified and copied into the cache; ``CostModel.tier_load_s``).
    # ``pdserve profile`` measures it (``profile.tier_load_bandwidth``); elsewhere the default,
    # measured here. On a GPU host the tier is host memory (/dev/shm) and the copy to the device
    # crosses PCIe (Gen5 x16: ~50 GB/s) after the same file read: the read is the slower part, so
    # the GPU profiles keep the default too (an assumption: a GPU server's host reads may be faster).
    kv_tier_bw: float = KV_TIER_LOAD_BW

    def __post_init__(self) -> None:  # JSON gives lists; keep the profile hashable
        object.__setattr__(self, "decode_points", tuple(tuple(p) for p in self.decode_points))
        object.__setattr__(self, "points_model", tuple(self.points_model))

    @property
    def flops(self) -> float:
        """Achievable FLOP/s."""
        return self.peak_flops * self.flops_efficiency

    @property
    def mem_bw(self) -> float:
        """Achievable memory bandwidth, bytes/s."""
        return self.peak_mem_bw * self.mem_bw_efficiency

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> HardwareProfile:
        try:
            values = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ProfileError("profile", f"cannot read {path}: {exc}") from exc
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ProfileError(unknown[0], f"unknown key in {path} (expected {sorted(names)})")
        return cls(**values)


_GB = 1e9
_TF = 1e12
# Efficiencies (stated assumptions, not measurements of ours):
# - MFU 0.55 for prefill: large-prompt GEMMs in vLLM/SGLang reach 50-60% of dense peak on
#   Hopper/Ampere (Megatron-LM and vLLM prefill profiles report this band).
# - MBU 0.75 for decode: weight-streaming kernels reach 70-80% of HBM peak (Databricks,
#   "LLM Inference Performance Engineering: Best Practices", 2023, measured MBU ~60-80%).
# KV link: one 400 Gb/s InfiniBand NIC per GPU (DGX H100/H200 and A100 80GB SuperPOD), ~50 GB/s,
# at 0.8 efficiency; 1 ms per transfer (RDMA registration + RPC, Mooncake/NIXL report ~0.1-1 ms).
_MFU, _MBU, _IB, _XFER_S, _STEP_S = 0.55, 0.75, 50 * _GB * 0.8, 1e-3, 2e-3

GPU_PROFILES = {
    "H100": HardwareProfile("H100", 989 * _TF, _MFU, 3.35e12, _MBU, 80 * _GB, _IB, _XFER_S, 450 * _GB, _STEP_S,
                            source="NVIDIA H100 SXM5 datasheet: 989 TFLOP/s dense BF16, 3.35 TB/s HBM3, "
                                   "80 GB, NVLink 900 GB/s bidirectional"),
    "H200": HardwareProfile("H200", 989 * _TF, _MFU, 4.8e12, _MBU, 141 * _GB, _IB, _XFER_S, 450 * _GB, _STEP_S,
                            source="NVIDIA H200 SXM datasheet: 989 TFLOP/s dense BF16, 4.8 TB/s HBM3e, "
                                   "141 GB, NVLink 900 GB/s bidirectional"),
    "A100": HardwareProfile("A100", 312 * _TF, _MFU, 2.039e12, _MBU, 80 * _GB, 25 * _GB * 0.8, _XFER_S,
                            300 * _GB, _STEP_S,
                            source="NVIDIA A100 SXM4 80GB datasheet: 312 TFLOP/s dense BF16, 2.039 TB/s "
                                   "HBM2e, NVLink 600 GB/s bidirectional; 200 Gb/s HDR IB per GPU"),
    "L40S": HardwareProfile("L40S", 362 * _TF, _MFU, 864 * _GB, _MBU, 48 * _GB, 50 * _GB * 0.8 / 2, _XFER_S,
                            32 * _GB, _STEP_S,
                            source="NVIDIA L40S datasheet: 362 TFLOP/s dense BF16 (733 with sparsity), "
                                   "864 GB/s GDDR6, 48 GB, PCIe Gen4 x16 (no NVLink)"),
}

DEFAULT_CPU_PROFILE = Path(__file__).parent / "profiles" / "cpu.json"


def get_profile(name: str) -> HardwareProfile:
    """A GPU profile by name, ``cpu`` for the fitted profile of this machine, or a JSON path."""
    if name.upper() in GPU_PROFILES:
        return GPU_PROFILES[name.upper()]
    if name.lower() == "cpu":
        if not DEFAULT_CPU_PROFILE.exists():
            raise ProfileError("hardware", f"no CPU profile at {DEFAULT_CPU_PROFILE}; run `pdserve profile` first")
        return HardwareProfile.load(DEFAULT_CPU_PROFILE)
    if Path(name).suffix == ".json":
        return HardwareProfile.load(name)
    raise ProfileError("hardware", f"unknown profile {name!r}; expected one of {sorted(GPU_PROFILES)}, "
                                   "'cpu' or a profile .json")
