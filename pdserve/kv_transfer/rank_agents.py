"""A worker's KV-transfer agents, one per tensor-parallel rank, driven as one (``RankAgents``).

A worker of tensor-parallel size N has one agent per rank, each over that rank's cache and
announcing that rank's ``KVShard`` (``pdserve.kv_transfer.sharding``). On the CPU every rank's
cache lives in rank 0's shared-memory file (``pdserve.engine.attention.kv_cache.shared_caches``), so rank
0 creates all N agents in its own process and one process does every transfer. (On CUDA each
rank's cache is in its own process's device memory: there each follower process would create
its rank's agent over its own cache and answer rank 0 over the step channel; not built yet,
so a TP > 1 worker on CUDA is refused where it would need agents: docs/gpu.md.)

What the worker sees is one agent:
- as a holder: ``local_metadata`` publishes every rank's (``metadata.publish``); the checksums
  of a block are every rank's groups, rank by rank (``block_checksums``); every rank's read
  notices come out of ``get_notifications``; ``read_guard`` and ``expect_reads`` apply to all;
- as a reader: ``connect`` gives a holder worker's ``RankSources`` (each reader rank's
  ``KVSource``), and ``start`` starts every rank's reads of a stretch of blocks with the same
  block ids; ``poll``, ``cancel`` and ``read_over`` take any of the handles it returned.
At size 1 it is the one agent, and every call what that agent's would be.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

from pdserve.kv_transfer.base import KVTransferAgent
from pdserve.kv_transfer.metadata import publish
from pdserve.kv_transfer.read import TransferHandle, TransferState
from pdserve.kv_transfer.source import KVSource
from pdserve.protos import kv_transfer_pb2

__all__ = ["RankAgents", "RankSources", "rank_agent_name"]


def rank_agent_name(worker: str, rank: int) -> str:
    """Rank ``rank``'s agent name: the worker's own for rank 0 (what it publishes), unique per rank."""
    return worker if rank == 0 else f"{worker}/tp{rank}"


@dataclass(frozen=True)
class RankSources:
    """A holder worker as a reader worker sees it: ``sources[s]`` is what reader rank s reads."""

    name: str  # the holder's published agent name, for logs
    sources: tuple[KVSource, ...]

    @property
    def sums_per_block(self) -> int:
        return self.sources[0].sums_per_block


class RankAgents:
    """The agents of a worker's ranks; ``agents[r]`` is rank r's. They share one
    ``TransferStats``: the worker's counts are every rank pair's reads together."""

    def __init__(self, agents: Sequence[KVTransferAgent]):
        if not agents:
            raise ValueError("a worker has at least one rank's agent")
        self.agents = tuple(agents)
        self.stats = self.agents[0].stats
        for agent in self.agents[1:]:
            agent.stats = self.stats
        self._owner: weakref.WeakKeyDictionary[TransferHandle, KVTransferAgent] = weakref.WeakKeyDictionary()

    @classmethod
    def of(cls, agent: KVTransferAgent | RankAgents) -> RankAgents:
        """``agent`` as a worker's agents (one rank's, or already a worker's)."""
        return agent if isinstance(agent, RankAgents) else cls([agent])

    @property
    def name(self) -> str:
        return self.agents[0].name

    @property
    def guards_reads(self) -> bool:
        return self.agents[0].guards_reads

    @property
    def read_guard(self) -> Optional[Callable[[str, list[int]], bool]]:
        return self.agents[0].read_guard

    @read_guard.setter
    def read_guard(self, guard: Optional[Callable[[str, list[int]], bool]]) -> None:
        for agent in self.agents:  # one lease table answers for every rank's blocks
            agent.read_guard = guard

    # ---- holder side ----------------------------------------------------------------
    def local_metadata(self) -> kv_transfer_pb2.AgentMetadata:
        """What the worker publishes: rank 0's metadata with the others' in ``tp_ranks``."""
        return publish([agent.local_metadata() for agent in self.agents])

    def block_checksums(self, block_ids: Sequence[int], last_block_bytes: Optional[int] = None) -> tuple[int, ...]:
        """Each block's checksums: every rank's (``checksums_per_block`` each), rank by rank,
        in block order, as ``RankRead.checksums`` takes them apart."""
        per_rank = [agent.block_checksums(block_ids, last_block_bytes) for agent in self.agents]
        if len(per_rank) == 1:
            return per_rank[0]
        counts = [agent.checksums_per_block for agent in self.agents]
        return tuple(s for b in range(len(block_ids))
                     for sums, k in zip(per_rank, counts) for s in sums[b * k:(b + 1) * k])

    def get_notifications(self) -> list[bytes]:
        """Every rank's read notices (a read of rank r's heads notifies rank r's agent)."""
        return [note for agent in self.agents for note in agent.get_notifications()]

    def expect_reads(self, expected: bool, urgent: bool = True) -> None:
        for agent in self.agents:
            agent.expect_reads(expected, urgent)

    # ---- reader side ----------------------------------------------------------------
    def connect(self, meta: kv_transfer_pb2.AgentMetadata) -> RankSources:
        """Connect every rank to the holder ranks it reads, from what the holder publishes.
        Raises InvalidTransferRequest (field and limit) where the two do not fit."""
        return RankSources(meta.agent_name, tuple(KVSource.connect(agent, meta) for agent in self.agents))

    def start(self, peer: RankSources, remote_block_ids: Sequence[int], local_block_ids: Sequence[int],
              start: int, end: int, **read) -> list[TransferHandle]:
        """Every rank's reads of blocks [start, end) (``KVSource.start``; ``read``: its keyword
        arguments). With ``sums`` in ``read``, every rank's are checked first (``require_sums``):
        a holder that sent none starts no read at all. If one rank's cannot start, those already
        started are cancelled."""
        for source in peer.sources:
            source.require_sums(read.get("sums"), start, end)
        handles: list[TransferHandle] = []
        try:
            for agent, source in zip(self.agents, peer.sources):
                for handle in source.start(agent, remote_block_ids, local_block_ids, start, end, **read):
                    self._owner[handle] = agent
                    handles.append(handle)
        except Exception:
            for handle in handles:
                self.cancel(handle)
            raise
        return handles

    def poll(self, handle: TransferHandle) -> TransferState:
        return self._owner[handle].poll(handle)

    def cancel(self, handle: TransferHandle) -> TransferState:
        return self._owner[handle].cancel(handle)

    def read_over(self, handle: TransferHandle) -> bool:
        """Whether no byte of the read can land here any more (``KVTransferAgent.read_over``)."""
        return self._owner[handle].read_over(handle)

    def landing(self) -> int:
        """Every rank's reads stopped but not yet ended by their backend."""
        return sum(agent.landing() for agent in self.agents)

    def close(self) -> None:
        for agent in self.agents:
            agent.close()
