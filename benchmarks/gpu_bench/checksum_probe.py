"""What a KV checksum of a served 8B prompt costs on CUDA (GPU run 8, BENCHMARKS.md): 32
scattered blocks of 2 MiB, as a 512-token prompt of Llama-3.1-8B's shape. ``block_checksums``
whole (best of three), then its parts: the gather on the device, a copy into pageable and into
pinned host memory, and XXH3 over the blocks on the host. Prints one JSON line. On the lent
host, after the bench's bundle is installed: ``python3 benchmarks/gpu_bench/checksum_probe.py``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import xxhash  # noqa: E402

from pdserve.kv_transfer.checksum import block_checksums  # noqa: E402

BLOCK_BYTES = 2 << 20
BLOCKS = 32


def ms(seconds: float) -> float:
    return round(seconds * 1e3, 2)


def main() -> int:
    device = torch.device("cuda")
    blocks = torch.randint(0, 255, (256, BLOCK_BYTES), dtype=torch.uint8, device=device)
    ids = list(range(3, 3 + 2 * BLOCKS, 2))
    whole = []
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        block_checksums(blocks, ids)
        whole.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    gathered = blocks.index_select(0, torch.tensor(ids, device=device))
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    pageable = gathered.cpu()
    t2 = time.perf_counter()
    pinned = torch.empty(gathered.shape, dtype=torch.uint8, pin_memory=True)
    t3 = time.perf_counter()
    pinned.copy_(gathered)
    t4 = time.perf_counter()
    for row in pageable.numpy():
        xxhash.xxh3_64_intdigest(memoryview(row))
    t5 = time.perf_counter()
    print(json.dumps({"block_checksums_ms": ms(min(whole)), "gather_ms": ms(t1 - t0), "to_pageable_ms": ms(t2 - t1),
                      "to_pinned_ms": ms(t4 - t3), "xxh3_host_ms": ms(t5 - t4), "mib": gathered.numel() / 2 ** 20}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
