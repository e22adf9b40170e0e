"""Tensor-parallel caches for the kv_transfer tests: a model's whole KV cache with known
contents, and each rank's share of it, as a worker of tensor-parallel size P holds it (rank r:
heads [r*H/P, (r+1)*H/P) of every token, ``pdserve.kv_transfer.sharding``).

What a rank must hold after a transfer is the unsharded cache sliced by head: what that rank
computes locally for the same prompt. Ranks are emulated: each holder rank is an agent in its
own OS process (``kv_helpers.Holder`` with a shard), each reader rank an agent of its own in
the test process, with its own cache tensor.
"""

from __future__ import annotations

import dataclasses

import torch

from pdserve.kv_transfer import create_agent
from pdserve.kv_transfer.sharding import KVShard

# A block of rows, each one token's K or V of one layer, its KV heads side by side, bf16: token-major
# (tokens, layers, K/V, KV heads, head dim), so that a read of a row prefix (``last_block_bytes``) holds
# the first tokens. The transfer layer sees only rows; the engine lays its rows out layer-major
# (pdserve.engine.attention.kv_cache) and reads a partly filled block whole.
BLOCK_SIZE, LAYERS, HEADS, HEAD_DIM = 4, 2, 4, 8
ROWS_PER_TOKEN = 2 * LAYERS
HEAD_BYTES = HEAD_DIM * 2


def full_cache(num_blocks: int, seed: int | None = None, heads: int = HEADS) -> torch.Tensor:
    """The unsharded cache: zeros, or seeded values identical in every process."""
    shape = (num_blocks, BLOCK_SIZE, LAYERS, 2, heads, HEAD_DIM)
    if seed is None:
        return torch.zeros(shape, dtype=torch.bfloat16)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def rank_cache(full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank`` of ``size``'s cache: its heads of ``full``, as a tensor of its own."""
    part = full.shape[-2] // size
    return full[..., rank * part:(rank + 1) * part, :].contiguous()


def tp_shard(rank: int, size: int, checksum_groups: int = 1, heads: int = HEADS) -> KVShard:
    return KVShard.of_rank(rank, size, num_kv_heads=heads, head_bytes=HEAD_BYTES, rows_per_token=ROWS_PER_TOKEN,
                           block_size=BLOCK_SIZE, dtype="bfloat16", checksum_groups=checksum_groups)


def shard_args(shard: KVShard) -> dict:
    """The shard as plain values, for a spawned holder process."""
    return dataclasses.asdict(shard)


def rank_agent(backend: str, name: str, num_blocks: int, seed: int | None, shard: dict | KVShard, **opts):
    """An agent over rank ``shard``'s part of the seeded cache (zeros with ``seed`` None)."""
    shard = shard if isinstance(shard, KVShard) else KVShard(**shard)
    cache = rank_cache(full_cache(num_blocks, seed, shard.num_kv_heads), shard.tp_rank, shard.tp_size)
    return create_agent(backend, name, cache, shard=shard, **opts)


def worker_checksums(holders, block_ids: list[int], last_block_bytes_of=None) -> tuple[int, ...]:
    """What a holder worker sends with its lease: each rank's checksums of ``block_ids``, block by
    block, rank by rank (``RankRead.checksums`` reads them so). ``last_block_bytes_of(rank)``: the
    bytes of the last block each rank sums (None: whole blocks)."""
    per_rank = [h.checksums(block_ids, None if last_block_bytes_of is None else last_block_bytes_of(r))
                for r, h in enumerate(holders)]
    groups = len(per_rank[0]) // len(block_ids)
    return tuple(s for b in range(len(block_ids)) for sums in per_rank for s in sums[b * groups:(b + 1) * groups])
