"""What a peer announces (``AgentMetadata``) and what an agent checks of it before it sizes or
reads anything, and the metadata a tensor-parallel worker publishes for all its ranks.

A worker of tensor-parallel size P has one agent per rank, each over its rank's cache. Its
rank 0 publishes its own metadata with the other ranks' in ``tp_ranks`` (``publish``); a reader
takes them apart with ``ranks_of`` and connects each of its ranks to the holder ranks its
``read_plan`` names (``pdserve.kv_transfer.sharding``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from pdserve.kv_transfer.errors import InvalidTransferRequest
from pdserve.kv_transfer.layout import CacheLayout
from pdserve.kv_transfer.sharding import KVShard, check_compatible
from pdserve.protos import kv_transfer_pb2

__all__ = ["block_ids", "check_peer", "peer_shard", "publish", "ranks_of"]


def peer_shard(meta: kv_transfer_pb2.AgentMetadata) -> Optional[KVShard]:
    """The shard a peer announces, None if it announces none; raises InvalidTransferRequest
    (naming the field) for one that cannot be or does not match its block size."""
    if not meta.HasField("shard"):
        return None
    shard = KVShard.from_proto(meta.shard)
    if shard.block_bytes != meta.block_bytes:
        raise InvalidTransferRequest(
            f"peer {meta.agent_name!r} announces a shard of {shard.block_bytes} bytes a block but block_bytes="
            f"{meta.block_bytes}", field="shard", limit=meta.block_bytes, peer=meta.agent_name)
    return shard


def check_peer(meta: kv_transfer_pb2.AgentMetadata, *, name: str, backend: str, layout: CacheLayout,
               shard: Optional[KVShard], max_peer_blocks: int) -> None:
    """Raise InvalidTransferRequest, naming the field and the limit, unless agent ``name`` (of
    ``backend``, over ``layout`` and ``shard``) can read from the peer ``meta`` announces. Two
    agents that both announce shards may hold different heads (``check_compatible``); otherwise
    blocks move whole and must be the same size."""
    if not isinstance(meta, kv_transfer_pb2.AgentMetadata):
        raise InvalidTransferRequest(f"metadata must be an AgentMetadata message, got {type(meta).__name__}",
                                     field="metadata")
    peer = meta.agent_name
    if not peer or peer == name:
        raise InvalidTransferRequest(f"peer agent_name must be non-empty and differ from this agent's {name!r}, "
                                     f"got {peer!r}", field="agent_name")
    if meta.backend != backend:
        raise InvalidTransferRequest(
            f"peer {peer!r} uses backend {meta.backend!r} but this agent uses {backend!r}; both sides must set the "
            "same kv_transfer_backend", field="backend", limit=backend, peer=peer)
    theirs = peer_shard(meta)
    if shard is not None and theirs is not None:
        check_compatible(shard, theirs)
    elif meta.block_bytes != layout.block_bytes:
        raise InvalidTransferRequest(
            f"block_bytes mismatch: peer {peer!r} has {meta.block_bytes}, this agent has {layout.block_bytes}; "
            "both caches need the same block layout", field="block_bytes", limit=layout.block_bytes, peer=peer)
    if not 1 <= meta.num_blocks <= max_peer_blocks:
        raise InvalidTransferRequest(
            f"peer {peer!r} announces num_blocks={meta.num_blocks}; a peer may have 1 to max_peer_blocks="
            f"{max_peer_blocks}", field="num_blocks", limit=max_peer_blocks, peer=peer)
    if meta.base_address + meta.num_blocks * meta.block_bytes > 1 << 64:
        raise InvalidTransferRequest(
            f"peer {peer!r} announces num_blocks={meta.num_blocks} of {meta.block_bytes} bytes at "
            f"{meta.base_address:#x}, past the end of a 64-bit address space", field="num_blocks",
            limit=((1 << 64) - meta.base_address) // meta.block_bytes, peer=peer)


def block_ids(field_name: str, ids: Sequence[int], num_blocks: int) -> tuple[int, ...]:
    """Validate block ids against ``[0, num_blocks)``; errors name the field and the limit."""
    try:
        out = tuple(int(i) for i in ids)
    except (TypeError, ValueError) as exc:
        raise InvalidTransferRequest(f"{field_name} must be a sequence of ints: {exc}", field=field_name) from None
    if not out:
        raise InvalidTransferRequest(f"{field_name} must not be empty", field=field_name, limit=1)
    bad = [i for i in out if i < 0 or i >= num_blocks]
    if bad:
        raise InvalidTransferRequest(f"{field_name} has ids out of range [0, {num_blocks}): {bad[:8]}",
                                     field=field_name, limit=num_blocks)
    return out


def publish(ranks: Sequence[kv_transfer_pb2.AgentMetadata]) -> kv_transfer_pb2.AgentMetadata:
    """What a worker publishes (``GetAgentMetadata``): rank 0's metadata carrying the others'
    in ``tp_ranks``; ``ranks[r]`` is rank r's ``local_metadata()``. One rank: its own, as is."""
    out = kv_transfer_pb2.AgentMetadata()
    out.CopyFrom(ranks[0])
    out.tp_ranks.extend(ranks[1:])
    ranks_of(out)  # refuse to publish what no reader would take
    return out


def ranks_of(meta: kv_transfer_pb2.AgentMetadata) -> tuple[kv_transfer_pb2.AgentMetadata, ...]:
    """A holder worker's rank metadata in rank order (each without ``tp_ranks``), from what it
    publishes. Metadata with no shard is one rank. Raises InvalidTransferRequest unless it holds
    exactly ranks 0 .. tp_size - 1 of one size."""
    first = kv_transfer_pb2.AgentMetadata()
    first.CopyFrom(meta)
    del first.tp_ranks[:]
    ranks = [first, *meta.tp_ranks]
    if not meta.HasField("shard"):
        if len(ranks) > 1:
            raise InvalidTransferRequest(f"peer {meta.agent_name!r} lists {len(ranks) - 1} other ranks but no shard",
                                         field="shard", peer=meta.agent_name)
        return (first,)
    size = meta.shard.tp_size
    got = sorted(r.shard.tp_rank for r in ranks)
    if got != list(range(size)) or any(r.shard.tp_size != size or r.tp_ranks for r in ranks):
        raise InvalidTransferRequest(
            f"peer {meta.agent_name!r} of tensor-parallel size {size} publishes ranks {got}; it must publish ranks "
            f"0 .. {size - 1} once each, of that size", field="tp_ranks", limit=size, peer=meta.agent_name)
    return tuple(sorted(ranks, key=lambda r: r.shard.tp_rank))
