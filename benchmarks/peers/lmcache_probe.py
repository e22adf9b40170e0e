"""LMCache's CPU and local-disk storage probed with pdserve's block geometry: what
docs/kv_tier.md ("Why not LMCache (evaluated)") reports. Run in a scratch virtualenv outside
the project's, with lmcache installed without its dependencies next to the project's CPU torch:

    python3 -m venv /tmp/lmc-venv
    /tmp/lmc-venv/bin/pip install --no-deps lmcache==0.5.6
    echo "$PWD/.venv/lib/python3.11/site-packages" > /tmp/lmc-venv/lib/python3.11/site-packages/zz_project.pth
    /tmp/lmc-venv/bin/pip install cachetools aiofile aiofiles msgspec sortedcontainers nvtx py-cpuinfo \\
        blake3 numba pyzmq redis aiohttp
    /tmp/lmc-venv/bin/python benchmarks/peers/lmcache_probe.py /tmp/lmc-store

(``pip install --dry-run -c requirements.lock lmcache`` shows why it cannot go in the project's
venv.) Stores four blocks of SmolLM2-135M in bfloat16 (16 tokens x 30 layers x K/V x 3 heads x
64 dims = 368,640 bytes), permuted into LMCache's layer-major chunk, through
``LocalCPUBackend`` + ``LocalDiskBackend``; reads one back; then overwrites 64 bytes of a second
block's file, truncates a third, and asks a second backend over the same directory for the
fourth. Prints what came back each time.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

LAYERS, HEADS, DIM, BLOCK = 30, 3, 64, 16  # SmolLM2-135M's KV, pdserve's block size


def to_chunk(block: torch.Tensor) -> torch.Tensor:
    """pdserve's layer-major block (layers, 2, 16, heads, dim) as LMCache's KV_2LTD chunk: the
    same order, a view."""
    return block.reshape(LAYERS, 2, BLOCK, HEADS * DIM)


def from_chunk(chunk: torch.Tensor) -> torch.Tensor:
    return chunk.reshape(LAYERS, 2, BLOCK, HEADS, DIM)


def verdict(obj, expected: torch.Tensor) -> str:
    if obj is None:
        return "refused (None)"
    return "bit-equal" if torch.equal(from_chunk(obj.tensor), expected) else "returned with DIFFERENT bytes, no error"


def main(directory: str) -> None:
    os.makedirs(directory, exist_ok=True)
    cfg = LMCacheEngineConfig.from_defaults(chunk_size=BLOCK, local_cpu=True, max_local_cpu_size=0.05,
                                            local_disk=f"file://{directory}", max_local_disk_size=0.1)
    meta = LMCacheMetadata(model_name="smollm2", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                           kv_dtype=torch.bfloat16, kv_shape=(LAYERS, 2, BLOCK, HEADS, DIM), chunk_size=BLOCK)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    disk = LocalDiskBackend(cfg, loop, LocalCPUBackend(cfg, meta), dst_device="cpu", metadata=meta)
    keys, blocks = [], []
    for i in range(4):
        key = CacheEngineKey("smollm2", 1, 0, 0x1234 + i, torch.bfloat16)
        block = torch.randn(LAYERS, 2, BLOCK, HEADS, DIM).to(torch.bfloat16)
        obj = disk.local_cpu_backend.allocate(torch.Size([LAYERS, 2, BLOCK, HEADS * DIM]), torch.bfloat16,
                                              fmt=MemoryFormat.KV_2LTD)
        obj.tensor.copy_(to_chunk(block))
        disk.submit_put_task(key, obj)
        keys.append(key)
        blocks.append(block)
    time.sleep(2)  # the puts are asynchronous
    for key in keys[:1]:
        path = disk._key_to_path(key)
        print(f"file {os.path.basename(path)}: {os.path.getsize(path)} bytes")
    print("round trip:", verdict(disk.get_blocking(keys[0]), blocks[0]))
    with open(disk._key_to_path(keys[1]), "r+b") as f:
        f.seek(4096)
        f.write(b"\xff" * 64)
    print("64 bytes overwritten:", verdict(disk.get_blocking(keys[1]), blocks[1]))
    with open(disk._key_to_path(keys[2]), "r+b") as f:
        f.truncate(1000)
    got = disk.get_blocking(keys[2])
    print("truncated to 1,000 bytes:", "refused (None)" if got is None else "returned a full-size object, no error")
    second = LocalDiskBackend(cfg, loop, LocalCPUBackend(cfg, meta), dst_device="cpu", metadata=meta)
    print("a second backend over the directory sees the fourth block:", second.contains(keys[3]))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/lmc-store")
