"""Where one reader rank reads a holder worker's KV (``KVSource``): the holder ranks its
``read_plan`` names, each connected once as a peer of the rank's agent, and a transfer's reads,
one per rank pair, started together.

A decode worker's every rank does the same with its own agent and the same arguments: the
holder's published metadata (``connect``), then for each stretch of blocks the handle's block
ids, its own block ids, the lease token and the holder's checksums (``start``). Between two
single-rank workers (or agents without shards) a source is the one peer and one read a block
stretch, byte for byte the read of before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from pdserve.kv_transfer.base import KVTransferAgent
from pdserve.kv_transfer.errors import InvalidTransferRequest, UnverifiedTransfer
from pdserve.kv_transfer.handoff import ReadNotice
from pdserve.kv_transfer.metadata import peer_shard, ranks_of
from pdserve.kv_transfer.read import TransferHandle
from pdserve.kv_transfer.sharding import RankRead, read_plan
from pdserve.protos import kv_transfer_pb2

__all__ = ["KVSource"]


@dataclass(frozen=True)
class KVSource:
    """A holder worker as one reader rank sees it: ``peers[i]`` is the agent it reads
    ``reads[i]`` from. ``reads`` is empty where the holder or the reader has no shard: then
    the one peer's blocks move whole."""

    name: str  # the holder's published agent name (its rank 0's), for logs
    peers: tuple[str, ...]
    reads: tuple[RankRead, ...] = ()

    @classmethod
    def connect(cls, agent: KVTransferAgent, meta: kv_transfer_pb2.AgentMetadata) -> KVSource:
        """Add to ``agent`` the holder ranks it reads, from what the holder publishes (its rank
        0's metadata, the others' in ``tp_ranks``). Raises InvalidTransferRequest naming the
        field and the limit where the two do not fit (sizes that do not divide one another)."""
        ranks = ranks_of(meta)
        if agent.shard is None or not meta.HasField("shard"):
            if len(ranks) > 1:
                raise InvalidTransferRequest(
                    f"holder {meta.agent_name!r} has {len(ranks)} tensor-parallel ranks but agent {agent.name!r} "
                    "has no shard: it reads whole blocks of one agent only", field="shard", peer=meta.agent_name)
            return cls(meta.agent_name, (agent.add_remote(ranks[0]),))
        reads = read_plan(agent.shard, [peer_shard(r) for r in ranks])
        return cls(meta.agent_name, tuple(agent.add_remote(ranks[r.holder.tp_rank]) for r in reads), reads)

    @property
    def sums_per_block(self) -> int:
        """How many checksums the holder sends a block (``RankRead.sums_per_block``)."""
        return self.reads[0].sums_per_block if self.reads else 1

    def checksums(self, i: int, sums: Optional[Sequence[int]], start: int, end: int) -> Optional[tuple[int, ...]]:
        """The checksums pair ``i`` checks for blocks [start, end), None where ``sums`` (None:
        not checked) does not cover them."""
        if sums is None:
            return None
        if not self.reads:
            return tuple(sums[start:end]) if len(sums) >= end else None
        return self.reads[i].checksums(sums, start, end)

    def require_sums(self, sums: Optional[Sequence[int]], start: int, end: int) -> None:
        """Fail closed: with ``sums`` (not None: the reader verifies), raise UnverifiedTransfer
        naming the holder if they do not cover every pair's blocks [start, end). Nothing is
        read then; a reader never reads, let alone uses, a block it cannot check."""
        if sums is None:
            return
        for i in range(max(1, len(self.reads))):
            if self.checksums(i, sums, start, end) is None:
                raise UnverifiedTransfer(
                    f"holder {self.name!r} sent {len(sums)} checksums, not those of blocks [{start}, {end}) "
                    f"({self.sums_per_block} a block): is verify_kv_transfers off there? A reader that "
                    "verifies reads nothing unchecked", field="verify_kv_transfers", peer=self.name)

    def start(self, agent: KVTransferAgent, remote_block_ids: Sequence[int], local_block_ids: Sequence[int],
              start: int, end: int, *, lease_token: str, last: bool, last_block_bytes: Optional[int] = None,
              sums: Optional[Sequence[int]] = None) -> list[TransferHandle]:
        """Start the reads of blocks [start, end) of the handle's ``remote_block_ids`` into
        ``local_block_ids`` (the same positions), one per rank pair. ``last``: the transfer's
        last reads, each with its part's notice (the lease ends once all have landed), the last
        block moving ``last_block_bytes`` of this rank's (None: whole); else early reads, with a
        notice only where the holder checks reads (tcp). ``sums``: the holder's checksums
        (``sums_per_block`` a block, from block 0), None: not checked; given, they must cover
        every block read (``require_sums``: else nothing starts). If one pair cannot start,
        the others already started are cancelled and the error raised."""
        self.require_sums(sums, start, end)
        handles: list[TransferHandle] = []
        try:
            for i, peer in enumerate(self.peers):
                part, parts = (self.reads[i].part, self.reads[i].parts) if self.reads else (0, 1)
                if last:
                    notify = ReadNotice(lease_token, True, part, parts).encode()
                else:  # a one-sided holder needs no notice, and one would complete only when it next progresses
                    notify = ReadNotice(lease_token, ends_lease=False).encode() if agent.guards_reads else b""
                handles.append(agent.start_read(
                    peer, remote_block_ids[start:end], local_block_ids[start:end], notify=notify,
                    last_block_bytes=last_block_bytes if last else None,
                    checksums=self.checksums(i, sums, start, end)))
        except Exception:
            for handle in handles:
                agent.cancel(handle)
            raise
        return handles
