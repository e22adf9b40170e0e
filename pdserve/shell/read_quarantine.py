"""Blocks a stopped read may still write, kept from every other use until the transport says
that read is over.

A read stops before its end when its request is aborted (the client left, the stream was
handed over), when another read of the same transfer failed, or when it fails itself
(``read_timeout_s``). Its agent calls it terminal at once, but the backend may go on writing
its local blocks (a NIXL READ in flight cannot be recalled: ``KVTransferAgent.read_over``).
Handed to another request, those blocks would take the late bytes into that request's KV,
which nothing checks (a local prefill) or which was checked already (a pull). So the owner
frees them with the block manager's ``quarantine`` (QUARANTINED: neither held nor free, never
allocated, never found; ``pdserve.engine.core.block_manager``) and this table releases them,
FREE again, once every read into them is over (``poll``, an engine-thread hook).

A read that never ends (a holder hung mid-read) keeps its blocks for good. They are counted
(``WorkerStats.kv_quarantined_blocks``, the gauge ``pdserve:kv_quarantined_blocks``), and a
worker with more than ``pdserve.router.liveness.QUARANTINE_BOUND`` of its cache quarantined for
``hang_timeout_s`` counts as hung: the router stops routing to it and the supervisor replaces
it, as a worker whose engine stopped.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pdserve.engine.core.block_manager import BlockManager
from pdserve.kv_transfer.base import KVTransferAgent
from pdserve.kv_transfer.rank_agents import RankAgents
from pdserve.kv_transfer.read import TransferHandle

# How often the hook asks about reads still landing: a stopped read over shared memory or a
# live link ends within milliseconds; one that does not is waited for, not spun on.
QUARANTINE_POLL_S = 0.005


@dataclass(frozen=True)
class Landing:
    """Reads stopped but not over, and the local blocks they may still write."""

    handles: tuple[TransferHandle, ...] = ()
    blocks: tuple[int, ...] = ()


class ReadQuarantine:
    """The stopped reads of one worker shell and the blocks they hold; engine thread only."""

    def __init__(self, agent: KVTransferAgent | RankAgents, blocks: BlockManager):
        self.agent, self.blocks = agent, blocks
        self._held: list[Landing] = []

    def stop(self, handles: Iterable[TransferHandle]) -> Landing:
        """Cancel each read not yet terminal and return those not over with their blocks: free
        the sequence with ``quarantine=landing.blocks``, then ``hold`` it."""
        handles = list(handles)
        for handle in handles:
            self.agent.cancel(handle)
        landing = tuple(h for h in handles if not self.agent.read_over(h))
        return Landing(landing, tuple(sorted({b for h in landing for b in h.local_block_ids})))

    def hold(self, landing: Landing) -> None:
        """Keep ``landing``'s blocks (QUARANTINED now) until its reads are over."""
        if landing.blocks:
            self._held.append(landing)

    def poll(self) -> float | None:
        """Hook: release the blocks whose reads are all over now; seconds until the next look
        (None: nothing held)."""
        still = []
        for landing in self._held:
            if all([self.agent.read_over(h) for h in landing.handles]):  # a list: every read is driven
                self.blocks.release_quarantined(landing.blocks)
            else:
                still.append(landing)
        self._held = still
        return QUARANTINE_POLL_S if still else None
