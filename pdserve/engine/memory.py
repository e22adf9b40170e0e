"""How much memory a worker's KV cache gets: an exact budget, or the rest of a share of the device.

``--gpu-memory-utilization F`` (vLLM's meaning) gives this worker F x the device's total memory
for everything it holds there: weights, the activations of its largest step, and its KV cache.
At start, before the weights load, the device's free memory must cover F x total (a device
already full of another process's memory refuses here, not later). After the weights load a
profile step (pdserve/engine/profile_step.py) runs one forward of the scheduler's
``max_num_batched_tokens`` and reads the peak this worker used; the KV cache gets what is left
of F x total (``kv_budget_for_share``). Two workers sharing one device each ask for their share
(0.45 and 0.45), and each sizes its cache from its own use, not the device's. A worker of
several tensor-parallel ranks measures on every rank, and the ranks agree on one block count
(pdserve/engine/distributed/memory_share.py).

The device is read by a ``MemoryProbe``:
- ``CudaMemory``: ``torch.cuda.mem_get_info`` for total and free; this worker's use is torch's
  peak reserved memory, plus what the process took outside torch's allocator since its first
  reading (cuBLAS workspaces, NCCL buffers). That second part is the device's free memory
  lost meanwhile, so a second process that allocates during this one's start would be counted
  as this one's: workers that share a device take turns to start (pdserve/engine/device_turn.py).
- ``HostMemory`` (a CPU worker): host RAM, its total and available memory from /proc/meminfo;
  this worker's use is its peak resident set (VmHWM, reset before the profile step where Linux
  allows it), which holds its weights, libraries and the step's activations.
- A test hands the engine a ``FixedMemory``: given numbers, nothing measured.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from pdserve.engine.errors import KVMemoryError

log = logging.getLogger(__name__)
GIB = 1 << 30
SETTING = "gpu_memory_utilization"


class MemoryProbe(Protocol):
    """What the sizing reads of a worker's device (bytes)."""

    name: str  # what the messages call the device ("cuda:0", "host RAM")

    def total_bytes(self) -> int:
        """The device's whole memory."""

    def free_bytes(self) -> int:
        """What the device could give a new allocation now (every process's use taken off)."""

    def start_peak(self) -> None:
        """Forget the peak so far: ``used_bytes`` measures from here (the profile step)."""

    def used_bytes(self) -> int:
        """This worker's use at its peak since ``start_peak``, weights included."""


@dataclass
class FixedMemory:
    """A device of given numbers (a test's stand-in: no test allocates gigabytes).
    ``profiles`` counts the profile steps measured on it."""

    total: int
    free: int
    used: int
    name: str = "stand-in device"
    profiles: int = 0

    def total_bytes(self) -> int:
        return self.total

    def free_bytes(self) -> int:
        return self.free

    def start_peak(self) -> None:
        self.profiles += 1

    def used_bytes(self) -> int:
        return self.used


class CudaMemory:
    """One CUDA device, as seen by this process (``torch.cuda``). Built before the weights load:
    its first reading is where the memory taken outside torch is counted from."""

    def __init__(self, device: torch.device):
        self.device = device
        self.name = str(device)
        self._free_at_start, self._total = torch.cuda.mem_get_info(device)
        self._reserved_at_start = torch.cuda.memory_reserved(device)

    def total_bytes(self) -> int:
        return self._total

    def free_bytes(self) -> int:
        return torch.cuda.mem_get_info(self.device)[0]

    def start_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def used_bytes(self) -> int:
        torch.cuda.synchronize(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        lost = self._free_at_start - torch.cuda.mem_get_info(self.device)[0]  # since the first reading
        outside_torch = max(0, lost - (reserved - self._reserved_at_start))
        return torch.cuda.max_memory_reserved(self.device) + outside_torch


class HostMemory:
    """Host RAM for a CPU worker: /proc/meminfo for the machine, /proc/self/status for this
    process (Linux; elsewhere ``KVMemoryError`` naming the setting)."""

    name = "host RAM"

    def __init__(self, proc: Path = Path("/proc")):
        self.proc = proc

    def total_bytes(self) -> int:
        return _kib_field(self.proc / "meminfo", "MemTotal")

    def free_bytes(self) -> int:
        return _kib_field(self.proc / "meminfo", "MemAvailable")

    def start_peak(self) -> None:
        try:  # "5" resets this process's peak resident set to its current one (Linux 4.0+)
            (self.proc / "self" / "clear_refs").write_text("5")
        except OSError:
            pass  # the peak then also holds what loading the weights took, a larger use

    def used_bytes(self) -> int:
        status = self.proc / "self" / "status"
        return max(_kib_field(status, "VmHWM"), _kib_field(status, "VmRSS"))


def _kib_field(path: Path, key: str) -> int:
    """``key:  N kB`` of a /proc file, in bytes."""
    try:
        for line in path.read_text().splitlines():
            name, _, rest = line.partition(":")
            if name == key:
                return int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError) as exc:
        raise KVMemoryError(SETTING, f"cannot read {key} from {path} ({exc}); size the KV cache exactly "
                                     "with --kv-cache-memory") from exc
    raise KVMemoryError(SETTING, f"{path} has no {key}; size the KV cache exactly with --kv-cache-memory")


def probe_for(device: torch.device) -> MemoryProbe:
    """The probe of ``device``: CUDA's, or host RAM's for a CPU worker."""
    if device.type == "cuda":
        return CudaMemory(device)
    if device.type == "cpu":
        return HostMemory()
    raise KVMemoryError(SETTING, f"cannot read the memory of a {device.type} device; size the KV cache exactly "
                                 "with --kv-cache-memory")


def check_free_at_start(share: float, total: int, free: int, name: str) -> None:
    """Refuse a share the device cannot give now: its free memory, before this worker loads
    anything, must hold ``share`` x ``total``."""
    asked = int(share * total)
    if free < asked:
        raise KVMemoryError(SETTING, f"{share:g} of {name}'s {readable(total)} asks for {readable(asked)}, but only "
                                     f"{readable(free)} is free at start (other processes hold the rest); lower "
                                     "--gpu-memory-utilization or free the device")


def kv_budget_for_share(share: float, total: int, used: int, name: str) -> int:
    """The KV cache's bytes: ``share`` x ``total`` less what this worker used at its peak
    (``used``: weights, and the activations of its profiled step). Refuses when nothing is left."""
    asked = int(share * total)
    left = asked - used
    if left <= 0:
        raise KVMemoryError(SETTING, f"{share:g} of {name}'s {readable(total)} is {readable(asked)}, and this worker "
                                     f"already uses {readable(used)} for its weights and its largest step: nothing "
                                     "is left for the KV cache; raise --gpu-memory-utilization, lower "
                                     "--max-num-batched-tokens, or size it with --kv-cache-memory")
    return left


def readable(n: int) -> str:
    """Bytes as people read them: GiB, or MiB below one GiB."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / (1 << 20):.1f} MiB"


@dataclass(frozen=True)
class CacheSize:
    """The KV cache a worker built, for its start-up log line and its stats."""

    num_blocks: int
    block_size: int
    block_bytes: int  # one block, every layer, on one rank
    ranks: int
    max_model_len: int
    source: str  # which setting sized it, with its numbers

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size

    def line(self) -> str:
        fits = self.tokens / self.max_model_len
        return (f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = {self.tokens} tokens "
                f"({readable(self.num_blocks * self.block_bytes * self.ranks)}); a {self.max_model_len}-token request "
                f"fits {fits:.2f} times ({self.source})")
