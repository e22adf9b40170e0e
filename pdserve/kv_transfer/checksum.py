"""Checksums of KV blocks: a reader knows the bytes it read are the bytes the holder finalised.

A transfer can complete with wrong contents: a block freed and reused under a late read, a
transport or memory fault. Decoding from such KV gives wrong tokens with no error anywhere.
So the holder checksums each block once its contents are final (a finished step computed it)
and sends the sums with the lease; the reader checksums what landed and fails the read on a
mismatch (``KVTransferAgent``: a read is DONE only if they match), before the engine is told
the KV is ready.

One checksum per block, over the bytes a read of it moves: the whole block, or its first
``last_block_bytes`` where a read moves only those. The engine's layer-major blocks always move
whole, a prompt's partly filled last one too (``CacheSpec.tail_bytes``); the prefix form stays
for callers whose blocks are laid out so that the first bytes are the first tokens. The hash is
xxHash's XXH3 (64 bits), chosen by measurement on real KV blocks of the default model
(SmolLM2-135M, bfloat16: 368,640 bytes a block) on this project's shared 2-core AMD EPYC: 6 us
a block while the blocks are in cache, 12-21 us from memory (a 1,024-token prompt: about 1 ms),
against 29 us for CRC-32C (the ``crc32c`` package, in hardware; installed for the measurement
only), 37 us for XXH64, 90-210 us for zlib's CRC-32 and 400-790 us for BLAKE2b.
``benchmarks/kv_transfer.py --verify`` measures them again on any machine. It is a check
against accidents, not an adversary: the internal plane's mTLS is that.

A tensor-parallel rank whose readers may hold only part of its heads (a decode pool of a larger
tensor-parallel size, ``pdserve.kv_transfer.sharding``) sums each block in equal groups of
heads instead (``row_checksums``): group g over its heads' bytes of every row, row after row;
one group over whole rows is exactly the block's checksum. Each reader rank checks the groups
its heads span.

A CUDA cache is checksummed on the host: the blocks are gathered on the device and copied into
one page-locked buffer per process, a bounded number of blocks at a time (``STAGING_BYTES``),
then hashed there. Measured on an NVIDIA H200 (BENCHMARKS.md, GPU run 8): a served 8B prompt of
512 tokens is 32 blocks of 2 MiB; copied into pageable memory they took 41.8 ms, into pinned
memory 1.4 ms, and XXH3 over them 8.8 ms on that host's CPU. Both the holder and the reader
checksum every read, so the pageable copy cost a request about 84 ms of its first token.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Optional

import numpy as np
import torch
import xxhash

from pdserve.kv_transfer.errors import InvalidTransferRequest
from pdserve.kv_transfer.read import TransferHandle

__all__ = ["ALGORITHM", "VERIFY_BY_DEFAULT", "block_checksums", "checksums_arg", "first_mismatch", "row_checksums",
           "verify"]

ALGORITHM = "xxh3_64"
# Whether workers checksum and verify transfers unless told otherwise (the
# ``verify_kv_transfers`` setting; off only to measure what it costs).
VERIFY_BY_DEFAULT = True
# A CUDA cache's blocks go through a page-locked host buffer of at most this many bytes (or one
# block, if larger), a group of blocks at a time: 64 MiB is 32 blocks of an 8B model's KV.
STAGING_BYTES = 64 << 20


def block_checksums(blocks: torch.Tensor, block_ids: Sequence[int],
                    last_block_bytes: Optional[int] = None) -> tuple[int, ...]:
    """The checksum of each of ``block_ids`` (in order) in ``blocks``, a (num_blocks,
    block_bytes) uint8 view of a cache; the last one over its first ``last_block_bytes``
    (None: whole)."""
    last = blocks.shape[1] if last_block_bytes is None else int(last_block_bytes)
    final = len(block_ids) - 1
    return tuple(xxhash.xxh3_64_intdigest(row[:last] if i == final else row)
                 for i, row in enumerate(_host_rows(blocks, block_ids)))


def row_checksums(blocks: torch.Tensor, block_ids: Sequence[int], row_bytes: int, offset: int,
                  group_bytes: int, groups: int, last_rows: int) -> tuple[int, ...]:
    """Checksums of a part of each row of ``block_ids`` (a read by head, ``sharding``): of
    each block, ``groups`` sums, group g over the bytes [offset + g * group_bytes, + group_bytes)
    of each of its ``row_bytes`` rows, row after row; the last block over its first
    ``last_rows`` rows. The sum of a whole row's one group is ``block_checksums``'s."""
    sums = []
    for i, block in enumerate(_host_rows(blocks, block_ids)):
        table = np.frombuffer(block, dtype=np.uint8).reshape(-1, row_bytes)
        if i == len(block_ids) - 1:
            table = table[:last_rows]
        for g in range(groups):
            part = table[:, offset + g * group_bytes:offset + (g + 1) * group_bytes]
            sums.append(xxhash.xxh3_64_intdigest(np.ascontiguousarray(part)))
    return tuple(sums)


def first_mismatch(blocks: torch.Tensor, block_ids: Sequence[int], expected: Sequence[int],
                   last_block_bytes: Optional[int] = None) -> Optional[int]:
    """The position in ``block_ids`` of the first block whose checksum is not ``expected``'s
    at that position; None when every one matches."""
    got = block_checksums(blocks, block_ids, last_block_bytes)
    return next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None)


def verify(blocks: torch.Tensor, handle: TransferHandle) -> Optional[str]:
    """Why the blocks a read landed in ``blocks`` do not match its checksums (naming the
    first block that differs and the peer), None when they match or it has none."""
    if handle.checksums is None:
        return None
    hs, what = handle.slice, ""
    if hs is None:
        bad = first_mismatch(blocks, handle.local_block_ids, handle.checksums, handle.last_block_bytes)
    else:
        got = row_checksums(blocks, handle.local_block_ids, hs.dst_row, hs.dst_offset, hs.group_bytes, hs.groups,
                            handle.last_rows)
        at = next((i for i, (a, b) in enumerate(zip(got, handle.checksums)) if a != b), None)
        bad = None if at is None else at // hs.groups
        if at is not None:
            what = f" (its checksum group {hs.first_group + at % hs.groups})"
    if bad is None:
        return None
    return (f"block {handle.remote_block_ids[bad]} of peer {handle.peer!r} (read into block "
            f"{handle.local_block_ids[bad]}) does not match its checksum{what}: its bytes changed on the way")


def checksums_arg(sums: Optional[Sequence[int]], num_blocks: int, peer: str,
                  per_block: int = 1) -> Optional[tuple[int, ...]]:
    """A read's ``checksums`` argument as a tuple of ints, ``per_block`` per block (a read by
    head: one per checksum group it covers); None stays None."""
    if sums is None:
        return None
    out = tuple(int(x) for x in sums)
    if len(out) != num_blocks * per_block:
        raise InvalidTransferRequest(f"checksums has {len(out)} values for {num_blocks} blocks; {per_block} per block",
                                     field="checksums", limit=num_blocks * per_block, peer=peer)
    return out


def _host_rows(blocks: torch.Tensor, block_ids: Sequence[int]) -> Iterator[memoryview]:
    """Each block's bytes in host memory, in order: views of a CPU cache (no copy); for a CUDA
    one, rows of the page-locked staging buffer, each valid until the next is taken (the
    buffer is the process's one, held until the iteration ends)."""
    if blocks.device.type == "cpu":
        host = blocks.numpy()
        for i in block_ids:
            yield memoryview(host[i])
        return
    yield from _staged_rows(blocks, block_ids, _STAGING)


def _staged_rows(blocks: torch.Tensor, block_ids: Sequence[int], stage: "_Staging") -> Iterator[memoryview]:
    """``_host_rows`` of a device cache: ``STAGING_BYTES`` of blocks at a time through ``stage``."""
    if not block_ids:
        return
    block_bytes = blocks.shape[1]
    group = max(1, STAGING_BYTES // block_bytes)
    with stage.lock:
        staging = stage.buffer(min(group, len(block_ids)) * block_bytes)
        for start in range(0, len(block_ids), group):
            ids = block_ids[start:start + group]
            gathered = blocks.index_select(0, torch.tensor(list(ids), device=blocks.device))
            host = staging[:gathered.numel()].view(gathered.shape)
            host.copy_(gathered)  # into page-locked memory: a DMA, not a pageable bounce
            rows = host.numpy()
            for row in rows:
                yield memoryview(row)


class _Staging:
    """The process's page-locked buffer for CUDA checksums, grown to the largest group asked
    for (at most ``STAGING_BYTES``, or one block) and kept: pinning costs more than copying."""

    def __init__(self, pinned: bool = True) -> None:
        self.lock = threading.Lock()
        self.pinned = pinned  # False: plain memory (tests of the grouping on a host without CUDA)
        self._buffer: Optional[torch.Tensor] = None

    def buffer(self, nbytes: int) -> torch.Tensor:
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = None
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)
        return self._buffer


_STAGING = _Staging()
