"""The prefix-cache events a worker publishes to routers, for KV-aware routing.

Both roles publish: a prefill worker the prompts it computed, a decode worker (with the
``decode_kv_reuse`` setting) the prompts it prefilled or read and the answers it generated, so
that a conversation's next turn goes where its KV already is. One log per engine: an elastic
worker's two roles share theirs (one epoch, one numbering), and ``ShellRpcs.Stats`` answers
from it whichever role is polled.

The block manager reports each hash that becomes cached and each one evicted
(``BlockManager.subscribe``); the engine's KV tier, where it has one (``--kv-offload-bytes``),
each block this engine stored there and each it removed (``KVTier.subscribe``). This log numbers
both kinds in one sequence (1, 2, ...), each marked ``in_tier`` or not, and keeps the newest
``capacity``. A router asks, in the ``Stats`` poll it already makes, for the events after the
last number it has seen; the answer carries them in order. If the router has never asked,
asks about another incarnation of the log (``epoch``: the worker restarted), or is so far
behind that events it needs were dropped, it gets a snapshot instead: every hash cached now,
as of the newest number, and every hash this engine put in its tier and has not removed.

The tier's set starts with what the directory holds when the log is made (``KVTier.stored_hashes``,
from the files' names alone): a worker that restarts, or joins a directory that other workers
of its host filled, announces those blocks in its first snapshot, so routers score them before
anything is written again. After that the tier's events are this engine's own: a block another
worker of the host stored in the shared tier is reported by that worker (and by this one too
once it evicts the same block and finds it stored), and one another worker removed stays in
this log's set until this engine's own store or removal says otherwise. The router reads tier entries by
the tier's id, so each worker's reports complete the others'; what it still misses, or a file
gone since, only costs a load that fails and a prompt computed (the tier checks every block it
gives back).

Why this design, rather than a push stream per router:

- No event is ever lost silently. A router either gets every event after its number, in
  order, or a snapshot that replaces what it had; a slow or restarted router heals at its
  next poll, and a restarted worker (new epoch) is never mistaken for the old one.
- No extra connection, thread or back-pressure: the poll exists already (load, liveness),
  and a router that stops polling costs the worker nothing but the bounded log.
- The index is advisory. Between two polls (0.2 s) it can be stale; a stale entry only
  sends a request to a worker that then misses and computes the prompt: time, never a wrong
  token (the worker's own lookup checks hashes and tokens).

Thread safety: events are recorded on the engine thread (the tier's from its writer thread too)
and read on the asyncio loop; a lock guards the log and the mirror sets that snapshots copy.
"""

from __future__ import annotations

import itertools
import secrets
import threading
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.engine.core.block_manager import BlockManager

if TYPE_CHECKING:
    from pdserve.engine.kv_tier.tier import KVTier


@dataclass(frozen=True)
class CacheEventBatch:
    """What one poll gets: events ``first_seq``..``last_seq`` (or a snapshot as of ``last_seq``)."""

    epoch: str
    last_seq: int
    snapshot: bool  # True: ``hashes`` is the whole cached set and tier set, replacing the router's view
    hashes: tuple[bytes, ...]
    cached: tuple[bool, ...]  # per hash: True stored, False evicted (all True in a snapshot)
    in_tier: tuple[bool, ...] = ()  # per hash: about the KV tier (True) or KV memory; () all False


class CacheEventLog:
    """A bounded, numbered log of prefix-cache and KV-tier events plus the set of hashes cached
    now and the set this engine holds in its tier."""

    def __init__(self, capacity: int, initial: tuple[bytes, ...] | list[bytes] = ()):
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.epoch = secrets.token_hex(8)  # this log's incarnation: numbers restart with it
        self._events: deque[tuple[int, bytes, bool, bool]] = deque(maxlen=capacity)  # (seq, hash, cached, in_tier)
        self._cached: set[bytes] = set(initial)
        self._tiered: set[bytes] = set()
        self._seq = 0
        self._lock = threading.Lock()

    @classmethod
    def following(cls, blocks: BlockManager, capacity: int, tier: KVTier | None = None) -> CacheEventLog:
        """A log of ``blocks``' changes from now on, starting from every hash cached now, and of
        ``tier``'s stores and removals by this engine (None: the engine has no tier), starting
        from every block its directory holds now (``KVTier.stored_hashes``). Make one per block
        manager: two would publish the same cache under two epochs."""
        log = cls(capacity, blocks.cached_hashes())
        blocks.subscribe(log.record)
        if tier is not None:
            tier.subscribe(log.record_tier)
            stored = tier.stored_hashes()  # after subscribing: a block stored meanwhile is in one or the other
            with log._lock:
                log._tiered.update(stored)
        return log

    @property
    def last_seq(self) -> int:
        return self._seq

    def record(self, block_hash: bytes, cached: bool) -> None:
        """The block manager's listener (engine thread)."""
        self._append(block_hash, cached, False, self._cached)

    def record_tier(self, block_hash: bytes, stored: bool) -> None:
        """The KV tier's listener: this engine stored ``block_hash`` there, or removed it."""
        self._append(block_hash, stored, True, self._tiered)

    def _append(self, block_hash: bytes, present: bool, in_tier: bool, mirror: set[bytes]) -> None:
        with self._lock:
            self._seq += 1
            self._events.append((self._seq, block_hash, present, in_tier))
            if present:
                mirror.add(block_hash)
            else:
                mirror.discard(block_hash)

    def cached_prefix(self, hashes: list[bytes]) -> int:
        """How many of ``hashes`` (a prompt's chained block hashes), from the first, this engine
        will not compute: cached, then, where the cache stops, in its tier (its lookup goes on
        there the same way)."""
        with self._lock:
            n = 0
            while n < len(hashes) and hashes[n] in self._cached:
                n += 1
            while n < len(hashes) and hashes[n] in self._tiered:
                n += 1
            return n

    def since(self, epoch: str, after: int) -> CacheEventBatch:
        """The events after number ``after`` of incarnation ``epoch``; a snapshot when they
        cannot all be given (another epoch, a number from the future, or events dropped)."""
        with self._lock:
            oldest = self._events[0][0] if self._events else self._seq + 1
            if epoch == self.epoch and after <= self._seq and after + 1 >= oldest:
                tail = list(itertools.islice(self._events, after + 1 - oldest, None))  # numbers are contiguous
                return CacheEventBatch(self.epoch, self._seq, False, tuple(h for _, h, _, _ in tail),
                                       tuple(c for _, _, c, _ in tail), tuple(t for _, _, _, t in tail))
            hashes = (*self._cached, *self._tiered)  # a hash may be in both: once each
            return CacheEventBatch(self.epoch, self._seq, True, hashes, (True,) * len(hashes),
                                   (False,) * len(self._cached) + (True,) * len(self._tiered))
