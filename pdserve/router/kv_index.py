"""The router's index of which worker caches which prompt blocks, for KV-aware routing.

Fed by the prefix-cache events each worker returns in its ``Stats`` answer: prefill workers
always, decode workers with ``decode_kv_reuse`` (their prompt and answer blocks, so a
conversation's next turn finds where its KV is)
(``pdserve.shell.cache_events`` explains the protocol). The index is advisory: between two
polls it can be stale, and a stale entry only costs time (the worker misses and computes the
prompt); it never changes an output token.

Hashes are ``pdserve.engine.core.block_manager.chain_hash`` over full blocks, so the router computes a
prompt's hashes exactly as the worker's lookup does, with the block size the worker reports.

A worker with a KV tier (``--kv-offload-bytes``) reports its ``kv_tier_id`` and, among its
events, the blocks it stored in the tier or removed from it (``in_tier``). The workers of a host
that share a directory share the id, and each can load what any of them stored: the index keeps
one set of hashes per tier id, and a block there counts for every worker of that id. A worker's
lookup goes on in its tier where its KV memory stops, so ``tier_tokens`` counts from the end of
the worker's cached prefix on. A removal that any worker of the tier reports removes the block
for all (the file is gone); a store is kept until its own worker's removal, its snapshot, or
its leaving.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

from pdserve.engine.core.block_manager import full_block_hashes, prompt_block_hashes
from pdserve.protos import worker_pb2

__all__ = ["KVIndex", "prompt_block_hashes"]


class KVIndex:
    """worker -> cached hashes and hash -> workers, with each worker's place in its event log."""

    def __init__(self) -> None:
        self._by_worker: dict[str, set[bytes]] = {}
        self._by_hash: dict[bytes, set[str]] = {}
        self._cursor: dict[str, tuple[str, int]] = {}  # worker -> (log epoch, last event applied)
        self.block_sizes: dict[str, int] = {}  # worker -> tokens per block, as it reports
        self.tier_ids: dict[str, str] = {}  # worker -> its KV tier's id (absent: no tier)
        self._tiered_by_worker: dict[str, set[bytes]] = {}  # what each worker reports stored in its tier
        self._by_tier: dict[str, dict[bytes, set[str]]] = {}  # tier id ("" never) -> hash -> workers that stored it

    def cursor(self, worker: str) -> tuple[str, int]:
        """What to ask ``worker`` for next: (epoch, events after this number)."""
        return self._cursor.get(worker, ("", 0))

    def num_blocks(self, worker: str) -> int:
        return len(self._by_worker.get(worker, ()))

    def apply(self, worker: str, events: worker_pb2.CacheEvents, block_size: int, tier_id: str = "") -> None:
        """Apply one poll's answer (``tier_id``: the worker's ``kv_tier_id``, "" without a
        tier). Answers may arrive out of order (two polls overlapping): what is older than the
        cursor is skipped, so an event is applied once, in order."""
        if not events.epoch or block_size <= 0:
            return  # a worker that publishes nothing (no prefix cache, or a decode worker with the reuse off)
        epoch, seq = self.cursor(worker)
        if self.tier_ids.get(worker, "") != tier_id:
            self._forget_tier(worker)
            if tier_id:
                self.tier_ids[worker] = tier_id
        if events.snapshot:
            if events.epoch == epoch and events.last_seq <= seq:
                return
            self.remove(worker)
            if tier_id:
                self.tier_ids[worker] = tier_id
            tiered = _in_tier(events)
            self._store(worker, [h for h, t in zip(events.block_hashes, tiered) if not t])
            self._store_tier(worker, [h for h, t in zip(events.block_hashes, tiered) if t])
        else:
            first = events.last_seq - len(events.block_hashes) + 1
            if events.epoch != epoch or first > seq + 1:
                self._cursor[worker] = ("", 0)  # cannot line up: the next poll gets a snapshot
                return
            skip = max(0, seq + 1 - first)
            for block_hash, cached, in_tier in zip(events.block_hashes[skip:], events.cached[skip:],
                                                   _in_tier(events)[skip:]):
                if in_tier:
                    self._store_tier(worker, (block_hash,)) if cached else self._evict_tier(worker, block_hash)
                elif cached:
                    self._store(worker, (block_hash,))
                else:
                    self._evict(worker, block_hash)
        self.block_sizes[worker] = block_size
        self._cursor[worker] = (events.epoch, max(seq if events.epoch == epoch else 0, events.last_seq))

    def expect(self, worker: str, token_ids: Sequence[int], cache_salt: str = "") -> None:
        """Record the full blocks of ``token_ids`` as cached on ``worker`` ahead of its events:
        the router saw it compute them (a finished stream). Only for a worker that publishes
        (its block size known); its next events add the same hashes again (no change) or evict
        them, and a snapshot replaces them, so the index heals as it does from any stale entry."""
        size = self.block_sizes.get(worker)
        if size is None or worker not in self._cursor:
            return
        self._store(worker, full_block_hashes(token_ids, size, cache_salt))

    def remove(self, worker: str) -> None:
        """Forget ``worker`` (it left the pool, or a snapshot replaces its view)."""
        for block_hash in self._by_worker.pop(worker, set()):
            self._evict_hash(worker, block_hash)
        self._forget_tier(worker)
        self._cursor.pop(worker, None)
        self.block_sizes.pop(worker, None)

    def overlaps(self, token_ids: Sequence[int], workers: Iterable[str], cache_salt: str = "") -> dict[str, int]:
        """Per worker, the prompt tokens its cache holds as a prefix under ``cache_salt``: the
        longest run of consecutive block hits from the first block, times its block size."""
        out: dict[str, int] = {}
        by_size: dict[int, list[str]] = {}
        for w in workers:
            size = self.block_sizes.get(w)
            if size is None:
                out[w] = 0
            else:
                by_size.setdefault(size, []).append(w)
        for size, group in by_size.items():
            active, blocks = set(group), 0
            counts = dict.fromkeys(group, 0)
            for block_hash in prompt_block_hashes(token_ids, size, cache_salt):
                active &= self._by_hash.get(block_hash, set())
                if not active:
                    break
                blocks += 1
                for w in active:
                    counts[w] = blocks
            out.update({w: n * size for w, n in counts.items()})
        return out

    def tier_tokens(self, token_ids: Sequence[int], cached: Mapping[str, int], cache_salt: str = "") -> dict[str, int]:
        """Per worker of ``cached`` (its cached prefix in tokens, as ``overlaps`` gives it), the
        prompt tokens after that prefix its KV tier holds as a run of consecutive blocks: what its
        lookup loads instead of computing. 0 for a worker without a tier."""
        out: dict[str, int] = {}
        hashes_by_size: dict[int, list[bytes]] = {}
        for w, device_tokens in cached.items():
            size, tier = self.block_sizes.get(w), self._by_tier.get(self.tier_ids.get(w, ""))
            if size is None or not tier:
                out[w] = 0
                continue
            if size not in hashes_by_size:
                hashes_by_size[size] = prompt_block_hashes(token_ids, size, cache_salt)
            hashes = hashes_by_size[size]
            start = n = device_tokens // size
            while n < len(hashes) and hashes[n] in tier:
                n += 1
            out[w] = (n - start) * size
        return out

    def num_tier_blocks(self, tier_id: str) -> int:
        """Blocks the index knows in the tier of ``tier_id``."""
        return len(self._by_tier.get(tier_id, ()))

    # ---- internals -------------------------------------------------------------------
    def _store_tier(self, worker: str, hashes: Iterable[bytes]) -> None:
        if worker not in self.tier_ids:
            return  # tier events from a worker that names no tier: nobody could load them
        tier = self._by_tier.setdefault(self.tier_ids[worker], {})
        mine = self._tiered_by_worker.setdefault(worker, set())
        for block_hash in hashes:
            mine.add(block_hash)
            tier.setdefault(block_hash, set()).add(worker)

    def _evict_tier(self, worker: str, block_hash: bytes) -> None:
        """The block left the tier, whoever stored it: gone for every worker of that tier."""
        tier = self._by_tier.get(self.tier_ids.get(worker, ""), {})
        for holder in tier.pop(block_hash, set()) | {worker}:
            self._tiered_by_worker.get(holder, set()).discard(block_hash)

    def _forget_tier(self, worker: str) -> None:
        """Drop what ``worker`` reported of its tier (it left, its tier changed, or a snapshot
        replaces its view); what other workers of the tier reported stays."""
        tier_id = self.tier_ids.pop(worker, "")
        tier = self._by_tier.get(tier_id, {})
        for block_hash in self._tiered_by_worker.pop(worker, set()):
            holders = tier.get(block_hash)
            if holders is not None:
                holders.discard(worker)
                if not holders:
                    del tier[block_hash]
        if tier_id in self._by_tier and not tier:
            del self._by_tier[tier_id]

    def _store(self, worker: str, hashes: Iterable[bytes]) -> None:
        mine = self._by_worker.setdefault(worker, set())
        for block_hash in hashes:
            mine.add(block_hash)
            self._by_hash.setdefault(block_hash, set()).add(worker)

    def _evict(self, worker: str, block_hash: bytes) -> None:
        mine = self._by_worker.get(worker)
        if mine is not None:
            mine.discard(block_hash)
        self._evict_hash(worker, block_hash)

    def _evict_hash(self, worker: str, block_hash: bytes) -> None:
        holders = self._by_hash.get(block_hash)
        if holders is not None:
            holders.discard(worker)
            if not holders:
                del self._by_hash[block_hash]


def _in_tier(events: worker_pb2.CacheEvents) -> list[bool]:
    """Per hash, whether the event is about the tier (a worker that predates the field sends none)."""
    flags = list(events.in_tier)
    return flags + [False] * (len(events.block_hashes) - len(flags))
