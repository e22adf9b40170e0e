"""A NIXL read by head through a staging buffer: whole blocks over the wire, heads put in place here.

A read between pools of different tensor-parallel sizes moves, of every row of every block, only
some heads (``pdserve.kv_transfer.sharding``). Named directly, that is a NIXL descriptor per row:
a Llama-8B block of 16 tokens has 1,024 rows of 1 KiB at TP 2, and UCX pays per descriptor, not
per byte (measured here: 0.30 GB/s for prefill TP 2 to decode TP 1, against 5 GB/s for whole
blocks between equal sizes). So ``StagedRead`` reads the holder's blocks whole, one descriptor a
run of adjacent blocks (``coalesce``), into a staging buffer (``StagingPool``: registered once,
reused), and then copies each row's slice into its place in the local cache (``put_in_place``).

Between a wider holder and a narrower reader (P > D) the bytes are the same as row by row. Between
a narrower holder and a wider reader (P < D) each reader rank reads the holder's whole block,
D/P times the bytes it keeps: still far fewer descriptors, and the copy it saves on the wire
costs little on NVLink. A buffer is ``STAGING_BYTES`` (two halves: the next chunk lands in one
while the last is put in place from the other), so a long prompt's read goes in chunks; only the
last chunk carries the holder's notification, so the holder counts one read as before. Bytes
land in the cache only by the copy, so a read stopped in flight writes only staging; the buffer
goes back to the pool only once NIXL says the read is over.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from pdserve.engine.attention.kv_cache import host_zeros
from pdserve.kv_transfer.layout import CacheLayout
from pdserve.kv_transfer.read import TransferHandle
from pdserve.kv_transfer.sharding import HeadSlice

STAGING_BYTES = 64 << 20  # a staging buffer; a chunk is half of it

__all__ = ["STAGING_BYTES", "StagedRead", "StagingPool", "coalesce", "put_in_place", "staging_tables"]


def coalesce(local: np.ndarray, remote: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pairs of NIXL descriptor tables (rows: address, length, device; row i of ``local`` pairs
    with row i of ``remote``, the same length) with every run of pairs that continue where the
    previous pair ended, on both sides, merged into one pair. Bytes and their order unchanged."""
    if len(local) < 2:
        return local, remote
    ends_l = local[:-1, 0] + local[:-1, 1]
    ends_r = remote[:-1, 0] + remote[:-1, 1]
    joins = (local[1:, 0] == ends_l) & (remote[1:, 0] == ends_r)
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    lengths = np.add.reduceat(local[:, 1], starts)
    merged_l, merged_r = local[starts].copy(), remote[starts].copy()
    merged_l[:, 1] = merged_r[:, 1] = lengths
    return merged_l, merged_r


def staging_tables(remote: CacheLayout, remote_ids, staging_address: int, device_id: int,
                   last_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """The descriptor pairs that read the holder's ``remote_ids`` whole (the last one its first
    ``last_bytes``) into consecutive blocks of a staging buffer at ``staging_address``, a run of
    adjacent holder blocks one pair: (local, remote) tables (address, length, dev)."""
    theirs = remote.block_descs(remote_ids, last_bytes)
    ours = theirs.copy()
    ours[:, 0] = staging_address + np.arange(len(ours), dtype=np.uint64) * np.uint64(remote.block_bytes)
    ours[:, 2] = device_id
    return coalesce(ours, theirs)


def _widest(hs: HeadSlice) -> torch.dtype:
    """The widest integer type every offset and length of ``hs`` is a whole number of."""
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if not (hs.src_row % size or hs.dst_row % size or hs.src_offset % size or hs.dst_offset % size
                or hs.length % size):
            return dtype
    return torch.uint8


def put_in_place(staged: torch.Tensor, blocks: torch.Tensor, local_ids, hs: HeadSlice, last_rows: int) -> None:
    """Copy each row's slice ``hs`` of the holder blocks in ``staged`` ((n, holder block bytes)
    uint8) into local ``blocks`` ((num_blocks, block bytes) uint8) ``local_ids``; of the last one
    its first ``last_rows`` rows only. In the widest word the slice allows: a byte-wise copy runs
    at a quarter of the speed (measured on a host). On a device, one indexed copy; on a host, one
    copy a block (an indexed copy of strided rows runs elementwise there, 4x slower than the loop)."""
    dtype = _widest(hs)
    size = torch.empty((), dtype=dtype).element_size()
    count, cols = len(local_ids), slice(hs.dst_offset // size, (hs.dst_offset + hs.length) // size)
    src = staged[:count].view(dtype).view(count, hs.block_rows, hs.src_row // size)
    src = src[:, :, hs.src_offset // size:(hs.src_offset + hs.length) // size]
    dst = blocks.view(dtype).view(blocks.shape[0], hs.block_rows, hs.dst_row // size)
    whole = count - (last_rows < hs.block_rows)
    if whole and blocks.is_cuda:
        dst[torch.tensor(list(local_ids[:whole]), device=blocks.device), :, cols] = src[:whole]
    elif whole:
        for i, block in enumerate(local_ids[:whole]):
            dst[block, :, cols].copy_(src[i])
    if whole < count:
        dst[local_ids[-1], :last_rows, cols] = src[-1, :last_rows]


class StagingPool:
    """One agent's staging buffers: made (on huge pages on a host) and registered with NIXL at first
    need, at most ``buffers`` of them, and kept for the agent's life. A read reuses a buffer: a
    fresh one costs its page faults and a registration each time, which at 64 MiB on a host is
    more than the read. ``take`` gives None while every buffer is in use; the read waits."""

    def __init__(self, nixl: Any, local: CacheLayout, device: torch.device, buffer_bytes: int, buffers: int = 2):
        self._nixl, self._device = nixl, device
        self.mem_type, self.device_id = local.nixl_mem_type, local.device_id
        self.buffer_bytes, self._limit = buffer_bytes, buffers
        self._free: list[tuple[torch.Tensor, Any]] = []
        self._made = 0

    def take(self, nbytes: int) -> Optional[tuple[torch.Tensor, Any]]:
        """A buffer of at least ``nbytes`` (its tensor and registration), or None for now."""
        for i, (buf, _) in enumerate(self._free):
            if buf.numel() >= nbytes:
                return self._free.pop(i)
        if self._made == self._limit and self._free:  # only smaller ones are free: make room
            self._drop(self._free.pop())
        if self._made == self._limit:
            return None
        size = max(nbytes, self.buffer_bytes)
        buf = (torch.empty(size, dtype=torch.uint8, device=self._device) if self._device.type == "cuda"
               else host_zeros((size,), torch.uint8))
        registration = self._nixl.register_memory([(buf.data_ptr(), size, self.device_id, "")], self.mem_type)
        self._made += 1
        return buf, registration

    def give(self, buffer: tuple[torch.Tensor, Any]) -> None:
        self._free.append(buffer)

    def _drop(self, buffer: tuple[torch.Tensor, Any]) -> None:
        self._nixl.deregister_memory(buffer[1])
        self._made -= 1

    def close(self) -> None:
        """Deregister the free buffers (those of reads still landing go with the agent)."""
        while self._free:
            self._drop(self._free.pop())


class StagedRead:
    """One read by head over NIXL (see the module docstring): ``post`` its first chunk, then
    ``poll`` until "DONE" (every chunk landed and in place) or "ERR"; ``end`` once it is stopped."""

    def __init__(self, nixl: Any, handle: TransferHandle, remote: CacheLayout, pool: StagingPool,
                 blocks: torch.Tensor):
        hs = handle.slice
        self._nixl, self._handle, self._remote, self._pool, self._blocks = nixl, handle, remote, pool, blocks
        n, self._holder_block = len(handle.local_block_ids), hs.block_rows * hs.src_row  # == remote.block_bytes
        self._per_chunk = max(1, min(n, pool.buffer_bytes // 2 // self._holder_block))
        self._chunks = [(i, min(i + self._per_chunk, n)) for i in range(0, n, self._per_chunk)]
        self._buffer: Optional[tuple[torch.Tensor, Any]] = None
        self._chunk = -1  # the chunk in flight
        self._xfer: Any = None
        handle.posted_descriptors = 0  # a side, over every chunk posted

    def post(self) -> str:
        """Post the first chunk once a staging buffer is free; the read's state as ``poll`` tells it."""
        return self.poll()

    def poll(self) -> str:
        """"PROC" while chunks are in flight (or the read waits for a buffer), "DONE" once all
        are in place, "ERR" if one failed."""
        if self._buffer is None:
            self._buffer = self._pool.take(min(2, len(self._chunks)) * self._per_chunk * self._holder_block)
            if self._buffer is None:
                return "PROC"
            return self._settle(self._post(0))
        return self._settle(self._nixl.check_xfer_state(self._xfer))

    def _settle(self, state: str) -> str:
        """Move on from the chunk in flight in NIXL's ``state``: while it has landed, post the next
        (before the copy, so that the wire and the copy overlap) and put the landed one in place."""
        while state == "DONE":
            self._xfer.release()
            self._xfer, k = None, self._chunk
            more = k + 1 < len(self._chunks)
            if more:
                state = self._post(k + 1)
            self._put_in_place(k)
            if not more:
                return "DONE"
        return state

    def _post(self, k: int) -> str:
        first, stop = self._chunks[k]
        h, hs = self._handle, self._handle.slice
        last_bytes = (h.last_rows if stop == len(h.local_block_ids) else hs.block_rows) * hs.src_row
        local, remote = staging_tables(self._remote, h.remote_block_ids[first:stop], self._slot(k).data_ptr(),
                                       self._pool.device_id, last_bytes)
        h.posted_descriptors += len(local)
        notify = h.notify if k == len(self._chunks) - 1 else b""
        self._xfer = self._nixl.initialize_xfer(
            "READ", self._nixl.get_xfer_descs(local, self._pool.mem_type),
            self._nixl.get_xfer_descs(remote, self._remote.nixl_mem_type), h.peer, notify)
        self._chunk = k
        return self._nixl.transfer(self._xfer)

    def _slot(self, k: int) -> torch.Tensor:
        """Where chunk ``k`` lands: one half of the buffer or the other, (per chunk, block bytes)."""
        part = self._per_chunk * self._holder_block
        return self._buffer[0][(k % 2) * part:(k % 2 + 1) * part].view(self._per_chunk, self._holder_block)

    def _put_in_place(self, k: int) -> None:
        first, stop = self._chunks[k]
        h = self._handle
        last_rows = h.last_rows if stop == len(h.local_block_ids) else h.slice.block_rows
        put_in_place(self._slot(k), self._blocks, h.local_block_ids[first:stop], h.slice, last_rows)
        if self._blocks.is_cuda:  # the slot is reused two chunks on, and the caller reads the cache next
            torch.cuda.current_stream(self._blocks.device).synchronize()

    def end(self) -> bool:
        """Release the chunk in flight, and give the staging buffer back, once NIXL has stopped
        writing into it; False while it still may."""
        if self._xfer is not None:
            if self._nixl.check_xfer_state(self._xfer) == "PROC":
                return False
            self._xfer.release()
            self._xfer = None
        if self._buffer is not None:
            self._pool.give(self._buffer)
            self._buffer = None
        return True
