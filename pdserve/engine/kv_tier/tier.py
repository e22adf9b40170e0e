"""``KVTier``: the block manager's ``LowerTier`` (pdserve/engine/core/block_tier.py) over one
engine's KV cache and a ``BlockStore`` directory (store.py).

- ``offload`` (engine thread, a CACHED block about to be handed out again): copies the block's
  row of the cache into a host buffer, synchronously (for a CUDA cache a pinned buffer; the
  copy waits for the cache's stream), and queues it. A writer thread writes the file. Until it
  has, ``contains`` and ``load`` serve the pending copy from memory. The buffers are a fixed
  pool (``max_pending_bytes``): when all hold blocks not yet written, ``offload`` waits for the
  writer up to ``offload_wait_s`` and then drops the block (``blocks_dropped``), so memory stays
  bounded and a burst of evictions never holds the engine's step for long.
- ``load`` (engine thread, a fresh block for a prompt's next block): the pending copy, a copy
  read ahead, or the file read and verified (store.py) straight into the cache row on a CPU
  cache, through a pinned staging buffer on CUDA. Only a verified block with the asked tokens
  returns True.
- ``prefetch`` (engine thread, a prompt queued; ``read_ahead``, by default next to a GPU
  only): a reader thread reads the prompt's blocks
  ahead, verified, into host buffers of the same pool, so that ``load`` is a copy from memory
  and the step that admits the prompt does not wait on files; ``fetching`` says it is still
  at it (the scheduler holds the prompt back meanwhile, while others run, for at most
  ``read_ahead_wait_s``). An offload takes the oldest copy read ahead when no buffer is free: a
  copy not used in time is read again, never waited for.
- Events (``subscribe``): ``(hash, True)`` when this engine offloads a block (or finds it
  stored already), ``(hash, False)`` when it removes a file (least recently used, or corrupt).
  Advisory for routers; called on the engine thread or the writer thread, so a listener must be
  thread-safe. ``stored_hashes`` lists what the directory holds, for a listener that starts
  late: from the files' names, without opening one.

Every failure of the store (a full disk, a vanished directory) is logged and reads as a miss or
a dropped block: the engine computes the prompt, it never fails a step for the tier.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from collections import OrderedDict
from typing import Callable, Sequence

import numpy as np
import torch

from pdserve.engine.kv_tier.stats import TierStats
from pdserve.engine.kv_tier.store import BlockStore, ReadResult

log = logging.getLogger(__name__)

TierListener = Callable[[bytes, bool], None]  # (block hash, True: stored here / False: removed here)
MAX_PENDING_BYTES = 64 << 20  # host copies waiting for the writer; at least one block
# How long an offload waits for a host buffer when every one holds a block not yet written
# (the writer is behind a burst of evictions): then the block is dropped, not the step held.
OFFLOAD_WAIT_S = 0.05
# Most block hashes a worker announces from its tier's directory at start (``stored_hashes``):
# 16 bytes each, 1 MiB in the first snapshot a router gets (its channels take 64 MiB a message,
# pdserve/wire/grpc_util.py); 24 GiB of the default model's blocks.
ANNOUNCE_LIMIT = 65536
# Longest a prompt is held back for its read-ahead (``fetching``; the scheduler holds it back only
# while other sequences run): past it the step loads what is still missing itself.
READ_AHEAD_WAIT_S = 0.2


class KVTier:
    """The KV tier of one engine (module docstring). ``cache``: the engine's KV cache,
    (num_blocks, ...) with one block per row; ``directory``: the namespace directory."""

    def __init__(self, cache: torch.Tensor, directory: str, capacity_bytes: int,
                 max_pending_bytes: int = MAX_PENDING_BYTES, offload_wait_s: float = OFFLOAD_WAIT_S,
                 read_ahead_wait_s: float = READ_AHEAD_WAIT_S, read_ahead: bool | None = None):
        self._rows = cache.view(torch.uint8).reshape(cache.shape[0], -1)  # (num_blocks, block_bytes)
        self.block_bytes = self._rows.shape[1]
        self.store = BlockStore(directory, capacity_bytes, self.block_bytes)
        self.tier_id = f"{socket.gethostname()}:{os.path.realpath(directory)}"
        on_cpu = self._rows.device.type == "cpu"
        slots = max(1, max_pending_bytes // self.block_bytes)
        self._host = torch.empty((slots, self.block_bytes), dtype=torch.uint8, pin_memory=not on_cpu)
        # A CUDA cache's file is read here, verified, then copied to the device; a CPU one's
        # straight into its row.
        self._staging = None if on_cpu else torch.empty(self.block_bytes, dtype=torch.uint8, pin_memory=True)
        # A CPU cache's rows are copied as numpy arrays: one plain memcpy. torch's copy_ splits a
        # block over its intra-op threads, and on a busy host one descheduled thread stalls the
        # copy for a scheduler tick (measured: 10-40 ms a block beside the writer thread, against
        # tens of microseconds).
        self._np = (self._rows.numpy(), self._host.numpy()) if on_cpu else None
        self._free_slots = list(range(slots))
        self.offload_wait_s = offload_wait_s
        self._pending: dict[bytes, tuple[int, tuple[int, ...]]] = {}  # hash -> (host slot, tokens)
        # Blocks read ahead, verified: hash -> (host slot, tokens, read-ahead key), oldest first.
        self._fetched: OrderedDict[bytes, tuple[int, tuple[int, ...], str]] = OrderedDict()
        self._fetching: dict[str, float] = {}  # read-ahead key -> when asked (time.monotonic)
        self.read_ahead_wait_s = read_ahead_wait_s
        # None: read ahead next to a GPU only. There the engine thread waits on the device during
        # a step and the host's cores are free for the reads; on a CPU host the reads take the
        # cores the step computes on, and measured no better than loading in the step
        # (docs/kv_tier.md, "Reading ahead").
        self.read_ahead = not on_cpu if read_ahead is None else read_ahead
        self._cond = threading.Condition()  # guards _pending, _fetched, _fetching and _free_slots
        self._queue: queue.Queue[bytes | None] = queue.Queue()
        self._reads: queue.Queue[tuple[str, list] | None] = queue.Queue()
        self._listeners: list[TierListener] = []
        self.blocks_offloaded = 0
        self.blocks_loaded = 0
        self.hit_tokens = 0
        self.corrupt_blocks = 0
        self.blocks_dropped = 0  # evicted while the writer was behind (offload_wait_s): not kept
        self.blocks_read_ahead = 0  # of blocks_loaded, those copied from a read-ahead
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
        self._writer.start()
        self._reader = threading.Thread(target=self._read_loop, name="kv-tier-reader", daemon=True)
        self._reader.start()

    def subscribe(self, listener: TierListener) -> None:
        """Call ``listener(hash, stored)`` at each block this engine stores or removes."""
        self._listeners.append(listener)

    def stored_hashes(self, limit: int = ANNOUNCE_LIMIT) -> list[bytes]:
        """What the tier holds now, for a listener that starts late (a worker's event log at
        start, when the directory may hold blocks from before a restart or from the other
        workers sharing it): the block files' hashes read from their names (at most ``limit``,
        the most recently used; ``BlockStore.stored_hashes``) and the blocks not written yet.
        A directory that cannot be read gives what is pending alone."""
        with self._cond:
            pending = list(self._pending)
        try:
            on_disk = self.store.stored_hashes(limit)
        except OSError as exc:
            log.warning("kv tier: %s unreadable (%s); its blocks are not announced", self.store.directory, exc)
            on_disk = []
        return list(dict.fromkeys(pending + on_disk))[:limit]

    def _emit(self, block_hash: bytes, stored: bool) -> None:
        for listener in self._listeners:
            listener(block_hash, stored)

    # ---- LowerTier ---------------------------------------------------------------------
    def offload(self, block_id: int, block_hash: bytes, token_ids: tuple[int, ...]) -> None:
        with self._cond:
            if self._closed or block_hash in self._pending:
                return
        try:
            if self.store.touch(block_hash):  # stored already (by this engine or another): now fresh
                self._emit(block_hash, True)  # and this engine vouches for it too (its poster may have left)
                return
        except OSError as exc:
            log.warning("kv tier: %s unusable (%s); block not offloaded", self.store.directory, exc)
            return
        with self._cond:
            if not self._cond.wait_for(lambda: self._free_slots or self._fetched, timeout=self.offload_wait_s):
                self.blocks_dropped += 1
                return
            slot = self._take_slot()
            self._copy_row(block_id, slot, down=True)
            self._pending[block_hash] = (slot, tuple(token_ids))
        self._queue.put(block_hash)
        self.blocks_offloaded += 1
        self._emit(block_hash, True)

    def contains(self, block_hash: bytes) -> bool:
        with self._cond:
            if block_hash in self._pending or block_hash in self._fetched:
                return True
        return self.store.exists(block_hash)

    def load(self, block_id: int, block_hash: bytes, token_ids: tuple[int, ...]) -> bool:
        with self._cond:
            pending = self._pending.get(block_hash)
            if pending is not None:
                if pending[1] != tuple(token_ids):
                    return False
                self._copy_row(block_id, pending[0], down=False)
                return self._loaded(token_ids)
            fetched = self._fetched.pop(block_hash, None)
            if fetched is not None:
                slot, stored_tokens, _ = fetched
                same = stored_tokens == tuple(token_ids)
                if same:
                    self._copy_row(block_id, slot, down=False)
                    self.blocks_read_ahead += 1
                self._release(slot)
                return same and self._loaded(token_ids)
        result = self._read(block_id, block_hash, token_ids)
        if result is ReadResult.CORRUPT:
            with self._cond:
                self.corrupt_blocks += 1
            log.warning("kv tier: block %s failed its check and was removed", block_hash.hex())
            self._emit(block_hash, False)
        return result is ReadResult.HIT and self._loaded(token_ids)

    def _copy_row(self, block_id: int, slot: int, down: bool) -> None:
        """Cache row ``block_id`` to host buffer ``slot`` (``down``) or back."""
        if self._np is not None:
            rows, host = self._np
            if down:
                np.copyto(host[slot], rows[block_id])
            else:
                np.copyto(rows[block_id], host[slot])
        elif down:
            self._host[slot].copy_(self._rows[block_id])
        else:
            self._rows[block_id].copy_(self._host[slot])

    def _take_slot(self, spare: str | None = None) -> int | None:
        """A host buffer (lock held): a free one, else the oldest read-ahead copy's, except those
        of read-ahead ``spare`` (the one asking); None if there is neither."""
        if self._free_slots:
            return self._free_slots.pop()
        for block_hash, (slot, _, key) in self._fetched.items():
            if key != spare:
                del self._fetched[block_hash]
                return slot
        return None

    def _release(self, slot: int) -> None:
        """Host buffer ``slot`` is free again (lock held)."""
        self._free_slots.append(slot)
        self._cond.notify()

    def _read(self, block_id: int, block_hash: bytes, token_ids: Sequence[int]) -> ReadResult:
        try:
            if self._staging is None:
                return self.store.read(block_hash, token_ids, self._rows[block_id].numpy())
            result = self.store.read(block_hash, token_ids, self._staging.numpy())
            if result is ReadResult.HIT:
                self._rows[block_id].copy_(self._staging)
            return result
        except OSError as exc:
            log.warning("kv tier: reading block %s failed (%s): computed instead", block_hash.hex(), exc)
            return ReadResult.MISS

    def _loaded(self, token_ids: Sequence[int]) -> bool:
        self.blocks_loaded += 1
        self.hit_tokens += len(token_ids)
        return True

    # ---- the writer --------------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            block_hash = self._queue.get()
            try:
                if block_hash is None:
                    return
                self._write(block_hash)
            finally:
                self._queue.task_done()

    def _write(self, block_hash: bytes) -> None:
        with self._cond:
            slot, token_ids = self._pending[block_hash]
        evicted: list[bytes] = []
        try:
            _, evicted = self.store.write(block_hash, token_ids, self._host[slot].numpy())
        except Exception as exc:  # the writer must go on: offload waits for its buffers
            log.warning("kv tier: writing block %s failed (%s): dropped", block_hash.hex(), exc)
            evicted = [block_hash]
        finally:
            with self._cond:
                del self._pending[block_hash]
                self._release(slot)
        for removed in evicted:
            self._emit(removed, False)

    # ---- reading ahead -----------------------------------------------------------------
    def prefetch(self, key: str, chain: Sequence[tuple[bytes, tuple[int, ...]]]) -> None:
        """Read the blocks of ``chain`` ((hash, tokens) in prompt order) into host buffers on the
        reader thread, verified, up to the first one the tier lacks or no buffer is left for;
        ``load`` then copies them from memory. ``fetching(key)`` says whether it is still at it.
        Nothing without ``read_ahead``."""
        with self._cond:
            if self._closed or not self.read_ahead:
                return
            self._fetching[key] = time.monotonic()
        self._reads.put((key, list(chain)))

    def fetching(self, key: str) -> bool:
        """Whether read-ahead ``key`` is still reading, for at most ``read_ahead_wait_s``."""
        with self._cond:
            asked = self._fetching.get(key)
        return asked is not None and time.monotonic() - asked < self.read_ahead_wait_s

    def _read_loop(self) -> None:
        while True:
            job = self._reads.get()
            if job is None:
                return
            key, chain = job
            try:
                for block_hash, token_ids in chain:
                    if not self._read_ahead(key, block_hash, token_ids):
                        break
            finally:
                with self._cond:
                    self._fetching.pop(key, None)

    def _read_ahead(self, key: str, block_hash: bytes, token_ids: tuple[int, ...]) -> bool:
        """One block of read-ahead ``key``; False ends it (not in the tier, no buffer, closed)."""
        with self._cond:
            if self._closed:
                return False
            if block_hash in self._pending or block_hash in self._fetched:
                return True
            slot = self._take_slot(spare=key)
            if slot is None:
                return False
        try:
            result = self.store.read(block_hash, token_ids, self._host[slot].numpy())
        except OSError as exc:
            log.warning("kv tier: reading block %s ahead failed (%s)", block_hash.hex(), exc)
            result = ReadResult.MISS
        with self._cond:
            if result is ReadResult.HIT:
                self._fetched[block_hash] = (slot, tuple(token_ids), key)
            else:
                self._release(slot)
                self.corrupt_blocks += result is ReadResult.CORRUPT
        if result is ReadResult.CORRUPT:
            log.warning("kv tier: block %s failed its check and was removed", block_hash.hex())
            self._emit(block_hash, False)
        return result is ReadResult.HIT

    def flush(self) -> None:
        """Wait until every offloaded block is in its file (or dropped)."""
        self._queue.join()

    def close(self) -> None:
        """Write what is pending, stop the writer and close the store."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
        for thread, jobs in ((self._reader, self._reads), (self._writer, self._queue)):
            if thread.is_alive():
                jobs.put(None)
                thread.join()
        self.store.close()

    def stats(self) -> TierStats:
        """This engine's counters and the directory's size (0 once closed)."""
        return TierStats(tier_id=self.tier_id, bytes_used=0 if self._closed else self.store.bytes_used(),
                         capacity_bytes=self.store.capacity_bytes, blocks_offloaded=self.blocks_offloaded,
                         blocks_loaded=self.blocks_loaded, hit_tokens=self.hit_tokens,
                         corrupt_blocks=self.corrupt_blocks)
