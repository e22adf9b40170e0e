"""A KV tier's counters, as a worker reports them (WorkerStats fields 55-61)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TierStats:
    tier_id: str  # the same for every worker of a host that shares the tier's directory
    bytes_used: int  # bytes the tier holds now (every worker's blocks)
    capacity_bytes: int  # its bound (KVTierConfig.offload_bytes)
    blocks_offloaded: int  # blocks this engine moved down
    blocks_loaded: int  # blocks this engine brought back, verified
    hit_tokens: int  # prompt tokens found in the tier (a part of the block manager's prefix_hits)
    corrupt_blocks: int  # blocks read back whose checksum or tokens did not match (recomputed)
