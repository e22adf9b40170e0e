"""Every block a read lands is checked against the holder's checksum before the read is DONE
(``pdserve.kv_transfer.checksum``). Between two real OS processes over real NIXL (UCX) and tcp:
the holder process takes its checksums, then a byte of a block changes in its memory before
the read, so the real transport carries the changed byte, as a block reused under a late read
or a memory fault would have it. The reader's read fails naming the block and the peer, and is
counted; the old agent called it DONE."""

import logging

import pytest
import torch
import xxhash
from kv_helpers import BLOCK_BYTES, make_cache, same_bytes

from pdserve.kv_transfer import InvalidTransferRequest, TransferState
from pdserve.kv_transfer.checksum import block_checksums


def read(reader, holder, remote, local, sums, last=None):
    peer = reader.add_remote(holder.metadata())
    handle = reader.start_read(peer, remote, local, b"", last_block_bytes=last, checksums=sums)
    reader.wait(handle, timeout_s=10)
    return handle


def test_a_read_whose_bytes_match_is_done_and_the_reader_sums_the_same(holder, reader):
    remote, local = [3, 0, 15], [10, 1, 5]
    sums = holder.checksums(remote)
    handle = read(reader, holder, remote, local, sums)
    assert handle.state is TransferState.DONE, handle.error
    assert reader.block_checksums(local) == sums
    assert same_bytes(reader.cache[local], holder.expected_cache()[remote])
    stats = reader.stats.snapshot()
    assert (stats.transfers, stats.failures, stats.verify_failures) == (1, 0, 0)


@pytest.mark.parametrize("offset", [0, BLOCK_BYTES // 2, BLOCK_BYTES - 1])
def test_a_byte_changed_in_transit_fails_the_read_naming_the_block_and_the_peer(holder, reader, caplog, offset):
    remote, local = [3, 7, 15], [10, 1, 5]
    sums = holder.checksums(remote)
    holder.flip(7, offset)  # after the checksum was taken: the read carries the changed byte
    try:
        with caplog.at_level(logging.WARNING, logger="pdserve.kv_transfer.base"):
            handle = read(reader, holder, remote, local, sums)
    finally:
        holder.flip(7, offset)
    assert handle.state is TransferState.FAILED and handle.verify_failed
    assert "block 7 of peer 'holder' (read into block 1) does not match its checksum" in handle.error
    assert "block 7 of peer 'holder'" in caplog.text
    stats = reader.stats.snapshot()
    assert (stats.transfers, stats.failures, stats.verify_failures, stats.bytes) == (0, 1, 1, 0)


def test_the_last_block_is_checked_over_the_bytes_it_moves_only(holder, reader):
    """A prompt's partly filled last block moves its first ``last_block_bytes``: a byte past
    them is not the reader's (nothing reads it), a byte within them is."""
    remote, local, tail = [2, 9], [4, 7], BLOCK_BYTES // 3
    sums = holder.checksums(remote, tail)
    holder.flip(9, tail)  # the first byte the read does not move
    try:
        assert read(reader, holder, remote, local, sums, tail).state is TransferState.DONE
    finally:
        holder.flip(9, tail)
    holder.flip(9, tail - 1)  # the last byte it moves
    try:
        assert read(reader, holder, remote, local, sums, tail).state is TransferState.FAILED
    finally:
        holder.flip(9, tail - 1)
    assert reader.stats.snapshot().verify_failures == 1


def test_checksums_must_be_one_per_block(holder, reader):
    peer = reader.add_remote(holder.metadata())
    with pytest.raises(InvalidTransferRequest) as err:
        reader.start_read(peer, [1, 2], [3, 4], b"", checksums=[1])
    assert (err.value.field, err.value.limit) == ("checksums", 2)
    assert reader.in_flight() == 0


def test_every_single_bit_of_a_block_changes_its_checksum():
    """The check catches the smallest change anywhere in a block (XXH3 makes a collision for a
    one-bit change as likely as any other: one in 2**64)."""
    rows = make_cache(1, seed=5).view(1, -1).view(torch.uint8).clone()
    (clean,) = block_checksums(rows, [0])
    seen = set()
    for byte in range(BLOCK_BYTES):
        for bit in range(8):
            rows[0, byte] ^= 1 << bit
            seen.add(block_checksums(rows, [0])[0])
            rows[0, byte] ^= 1 << bit
    assert len(seen) == 8 * BLOCK_BYTES and clean not in seen
    assert block_checksums(rows, [0]) == (clean,)


@pytest.mark.parametrize("staging_blocks", [1, 2, 3, 64])
def test_a_device_cache_staged_in_groups_sums_as_its_blocks_do(monkeypatch, staging_blocks):
    """A CUDA cache's blocks reach the host through one bounded buffer, a group at a time
    (``_staged_rows``, pinned there; plain here, where there is no CUDA): every group size,
    one block at a time to all at once, gives each block's own checksum, the last block over
    its first bytes, and the checksums by head too."""
    from pdserve.kv_transfer import checksum

    blocks = torch.randint(0, 256, (8, 96), dtype=torch.uint8)
    ids = [5, 0, 7, 2, 3]
    monkeypatch.setattr(checksum, "STAGING_BYTES", staging_blocks * 96)
    stage = checksum._Staging(pinned=False)
    staged = [bytes(row) for row in checksum._staged_rows(blocks, ids, stage)]
    assert staged == [blocks[i].numpy().tobytes() for i in ids]
    assert stage._buffer.numel() == min(staging_blocks, len(ids)) * 96
    monkeypatch.setattr(checksum, "_host_rows", lambda b, i: checksum._staged_rows(b, i, stage))
    assert block_checksums(blocks, ids, 40) == tuple(
        xxhash.xxh3_64_intdigest(blocks[i].numpy().tobytes()[:40 if n == 4 else 96])
        for n, i in enumerate(ids))
    by_head = checksum.row_checksums(blocks, ids, row_bytes=24, offset=8, group_bytes=8, groups=2, last_rows=2)
    assert len(by_head) == 2 * len(ids)
    assert by_head[:2] == tuple(xxhash.xxh3_64_intdigest(
        blocks[5].numpy().reshape(4, 24)[:, 8 + 8 * g:16 + 8 * g].copy().tobytes()) for g in range(2))
