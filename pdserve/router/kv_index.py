"""The router's index of which worker caches which prompt blocks, for KV-aware routing.

Fed by the prefix-cache events each worker returns in its ``Stats`` answer: prefill workers
always, decode workers with ``decode_kv_reuse`` (their prompt and answer blocks, so a
conversation's next turn finds where its KV is)
(``pdserve.shell.cache_events`` explains the protocol). The index is advisory: between two
polls it can be stale, and a stale entry only costs time (the worker misses and computes the
prompt); it never changes an output token.

Hashes are ``pdserve.engine.core.block_manager.chain_hash`` over full blocks, so the router computes a
prompt's hashes exactly as the worker's lookup does, with the block size the worker reports.
"""

from __future__ import annotations

from typing import Iterable, Sequence

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

    def cursor(self, worker: str) -> tuple[str, int]:
        """What to ask ``worker`` for next: (epoch, events after this number)."""
        return self._cursor.get(worker, ("", 0))

    def num_blocks(self, worker: str) -> int:
        return len(self._by_worker.get(worker, ()))

    def apply(self, worker: str, events: worker_pb2.CacheEvents, block_size: int) -> None:
        """Apply one poll's answer. Answers may arrive out of order (two polls overlapping):
        what is older than the cursor is skipped, so an event is applied once, in order."""
        if not events.epoch or block_size <= 0:
            return  # a worker that publishes nothing (no prefix cache, or a decode worker with the reuse off)
        epoch, seq = self.cursor(worker)
        if events.snapshot:
            if events.epoch == epoch and events.last_seq <= seq:
                return
            self.remove(worker)
            self._store(worker, events.block_hashes)
        else:
            first = events.last_seq - len(events.block_hashes) + 1
            if events.epoch != epoch or first > seq + 1:
                self._cursor[worker] = ("", 0)  # cannot line up: the next poll gets a snapshot
                return
            skip = max(0, seq + 1 - first)
            for block_hash, cached in zip(events.block_hashes[skip:], events.cached[skip:]):
                if cached:
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

    # ---- internals -------------------------------------------------------------------
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
