"""Which rows of a tensor-parallel worker's registered cache hold a block.

A worker with N tensor-parallel ranks registers every rank's cache as one block-first tensor,
rank-major (``pdserve.engine.kv_cache.shared_caches``): row ``r * (rows / N) + b`` is rank r's
part of block b, which holds that rank's KV heads. A block id names the same block on every
rank, so the agent's API takes block ids, and a read of blocks ``[b0, b1, ...]`` between two
workers of the same N moves rows ``[b0 on rank 0, ..., b0 on rank N-1, b1 on rank 0, ...]``
on each side: block-major, so each block's rows, and their checksums (one per row), stay
together. Each row moves whole: the rows of a partly filled last block are not contiguous, and
the bytes past its tokens are written by later steps before anything reads them.

For now both sides hold the same N (``check_peer_ranks``). Pure arithmetic; no model knowledge.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.kv_transfer.errors import InvalidTransferRequest
from pdserve.protos import kv_transfer_pb2


def rank_rows(block_ids: Sequence[int], total: int, ranks: int) -> tuple[int, ...]:
    """The rows holding ``block_ids`` in a cache of ``total`` rows over ``ranks`` ranks,
    block-major. At one rank, the block ids themselves."""
    if ranks == 1:
        return tuple(block_ids)
    per_rank = total // ranks
    return tuple(r * per_rank + b for b in block_ids for r in range(ranks))


def rows_to_blocks(rows: Sequence[int], total: int, ranks: int) -> list[int]:
    """The block ids ``rows`` (of a cache of ``total`` rows over ``ranks`` ranks) hold parts of."""
    if ranks == 1:
        return list(rows)
    return sorted({row % (total // ranks) for row in rows})


def check_ranks(rows: int, ranks: int) -> int:
    """``ranks``, if it splits a cache of ``rows`` rows evenly; else InvalidTransferRequest."""
    if ranks < 1 or rows % ranks:
        raise InvalidTransferRequest(f"ranks must be >= 1 and divide the cache's {rows} rows, got {ranks}",
                                     field="ranks", limit=rows)
    return int(ranks)


def check_peer_ranks(meta: kv_transfer_pb2.AgentMetadata, ranks: int) -> None:
    """Refuse a peer whose worker has another tensor-parallel size (0, from an older peer: 1)."""
    theirs = max(1, meta.tensor_parallel_size)
    if theirs != ranks:
        raise InvalidTransferRequest(
            f"peer {meta.agent_name!r} holds the KV of {theirs} tensor-parallel rank(s) and this agent of "
            f"{ranks}: KV moves between workers of the same tensor_parallel_size only (for now)",
            field="tensor_parallel_size", limit=ranks, peer=meta.agent_name)
