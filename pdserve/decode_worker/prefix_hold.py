"""A decode worker holds a prompt's cached prefix for a prefill worker's read: the reversed
pull (docs/architecture.md, "The reversed pull").

A conversation's next turn finds most of its prompt in the prefix cache of the decode worker
that decoded the last turn. When the router sends that turn to a prefill worker, it first asks
this worker to hold the prefix (``HoldPrefix``): the full blocks of the prompt found in the
prefix cache (never the block of its last token, which the prefill worker computes) are
pinned under a sequence of their own in the block manager (``BlockManager.share_prefix``), so
neither eviction nor reuse can touch them, and a lease (``pdserve.kv_transfer.handoff``) is
granted on them with their checksums, taken now: the prefix cache found them, so their
contents are final. The prefill worker claims the lease, reads the blocks it lacks, and its
last read's notice ends the lease; so do a ``Release`` (the router's, when the prefill worker
never read it; the prefill worker's, when its read failed) and expiry
(``pdserve.kv_transfer.lease_upkeep``). Whichever ends it frees the pin: the blocks go back
to the prefix cache as they were, cached and evictable. The streams decoding here are not
touched: the pin only adds a reference to blocks that stay as they are.

At any tensor-parallel size: a block id names the same block on every rank, so one pin holds
the prefix on every rank; the handle's checksums are every rank's groups, rank by rank
(``RankAgents.block_checksums``), and each reader rank reads its heads from the ranks that hold
them (``pdserve.kv_transfer.sharding``), as for a prefill worker's KV. The lease ends at the
last part's notice (every rank pair's read), whichever rank's agent it reaches.

Refused (no handle, nothing held): a worker whose agent another role shares (an elastic
worker: its prefill side consumes the agent's read notices).

The sums taken here are never of unverified bytes: with ``verify_kv`` every block in this
worker's prefix cache was computed here or read and checked, for a read its holder sent no
checksums for is refused before it starts (``pdserve.kv_transfer.source.KVSource.require_sums``);
without it, no sums are taken or sent at all.
"""

from __future__ import annotations

import secrets
import time

from pdserve.engine.llm_engine import LLMEngine
from pdserve.kv_transfer.handoff import KVHandle, Lease, LeaseTable, ReleaseReason
from pdserve.kv_transfer.lease_upkeep import upkeep
from pdserve.kv_transfer.rank_agents import RankAgents

# While a prefix is held, the engine thread looks for the read's notice this often.
HOLD_POLL_S = 0.005


class PrefixHolds:
    """The prefixes this decode worker holds for readers, under leases. Its methods run on
    the engine thread (the block manager is the engine's), but ``claim`` and a give-back,
    which touch the table alone (it has its own lock), as on a prefill worker."""

    def __init__(self, engine: LLMEngine, agent: RankAgents, lease_seconds: float, verify_kv: bool,
                 enabled: bool = True):
        self.engine, self.agent = engine, agent
        self.lease_seconds, self.verify_kv = lease_seconds, verify_kv
        self.enabled = enabled
        self.table = LeaseTable()
        if self.enabled:  # a tcp holder serves a read only under a claimed lease of this table
            agent.read_guard = self.table.read_allowed

    def hold(self, address: str, prompt: list[int], cache_salt: str, owner: str) -> KVHandle | None:
        """Engine thread: pin the cached full blocks of ``prompt``'s prefix under a new lease
        granted to ``owner``; its handle names ``address``. None where nothing is cached, or
        holds are refused here (module docstring). ``cache_salt`` is the request's
        ``kv_salt`` (pdserve/engine/core/block_hashes.py: its adapter folded in), as the router
        sends it, so that a prefix computed under one LoRA adapter is never held for another."""
        if not self.enabled:
            return None
        pin = f"prefix-hold.{secrets.token_urlsafe(12)}"  # the pin's sequence: no request id can name it
        alloc = self.engine.blocks.share_prefix(pin, prompt, cache_salt)
        if not alloc.block_ids:
            return None
        sums = self.agent.block_checksums(alloc.block_ids) if self.verify_kv else ()
        lease = self.table.grant(pin, list(alloc.block_ids), time.monotonic(), self.lease_seconds, owner=owner,
                                 checksums=sums, sums_per_block=max(1, len(sums) // len(alloc.block_ids)))
        self.agent.expect_reads(True)  # a one-sided read's notice needs the holder's progress
        return KVHandle(address, lease.block_ids, alloc.num_cached_tokens, lease.token, tuple(lease.checksums),
                        cache_salt)

    def claim(self, token: str, block_ids: list[int], renew: bool = False) -> Lease | None:
        """Any thread: as ``PrefillWorker.claim`` (raises LeaseRefused; None: no renewal)."""
        now = time.monotonic()
        if renew:
            return self.table.renew_claim(token, now, self.lease_seconds)
        return self.table.claim(token, block_ids, now, self.lease_seconds)

    def release(self, token: str, reason: ReleaseReason) -> bool:
        """Engine thread (for a reason that ends the lease): the ``Release`` RPC; False if it
        changed nothing."""
        lease = self.table.release(token, reason)
        if lease is not None and reason.ends_lease:
            self._ended(lease, reason)
        return lease is not None

    def poll(self) -> float | None:
        """Engine-thread hook: end the leases whose read landed or whose time ran out; how
        long until the next look (None: nothing held)."""
        if not self.table:
            return None
        now = time.monotonic()
        upkeep(self.table, self.agent.get_notifications(), now, self._ended)
        if not self.table:
            self.agent.expect_reads(False)  # the progress thread may sleep again
            return None
        return max(0.0, min(HOLD_POLL_S, self.table.next_deadline() - now))

    def _ended(self, lease: Lease, reason: ReleaseReason) -> None:
        """The lease ended: its pin goes, and the blocks are the prefix cache's again."""
        self.engine.blocks.free(lease.request_id)

    def __len__(self) -> int:
        return len(self.table)
