"""An agent over a tensor-parallel worker's caches (``ranks`` > 1: every rank's cache, rank-major,
``pdserve.kv_transfer.ranks``) takes block ids like any agent and moves every rank's part of
each block, whole, checked against a checksum per part; the tcp holder's guard sees the block
ids of the lease, not rows; and two workers of different tensor-parallel sizes refuse each
other, naming the setting. Both agents in this process, over real NIXL (UCX) and tcp."""

import pytest
from kv_helpers import BACKENDS, BLOCK_BYTES, make_cache, same_bytes

from pdserve.kv_transfer import InvalidTransferRequest, TransferState, create_agent
from pdserve.kv_transfer.ranks import rank_rows

RANKS = 2
HOLDER_BLOCKS, READER_BLOCKS = 16, 12  # per rank


@pytest.fixture(params=BACKENDS)
def pair(request):
    holder = create_agent(request.param, "holder", make_cache(RANKS * HOLDER_BLOCKS, seed=7), ranks=RANKS)
    reader = create_agent(request.param, "reader", make_cache(RANKS * READER_BLOCKS), ranks=RANKS)
    yield holder, reader
    reader.close()
    holder.close()


def test_a_read_moves_every_ranks_part_of_each_block(pair):
    holder, reader = pair
    guarded = []
    holder.read_guard = lambda note, blocks: guarded.append(blocks) or True
    remote, local = [3, 0, 15], [10, 1, 5]
    sums = holder.block_checksums(remote, BLOCK_BYTES // 3)  # a partly filled last block: moved whole
    assert len(sums) == RANKS * len(remote)
    peer = reader.add_remote(holder.local_metadata())
    handle = reader.start_read(peer, remote, local, b"token", last_block_bytes=BLOCK_BYTES // 3, checksums=sums)
    assert reader.wait(handle, timeout_s=10) is TransferState.DONE, handle.error
    for rank in range(RANKS):
        for r, l in zip(remote, local):
            assert same_bytes(reader.cache[rank * READER_BLOCKS + l], holder.cache[rank * HOLDER_BLOCKS + r])
    assert handle.nbytes == RANKS * len(remote) * BLOCK_BYTES
    assert reader.block_checksums(local) == sums
    if holder.guards_reads:  # tcp asks its guard about block ids, not rows (NIXL reads are one-sided)
        assert [0, 3, 15] in guarded and all(set(blocks) <= {0, 3, 15} for blocks in guarded)
    assert rank_rows([3, 0], RANKS * HOLDER_BLOCKS, RANKS) == (3, 19, 0, 16)


def test_block_ids_are_checked_against_the_blocks_of_one_rank(pair):
    holder, reader = pair
    peer = reader.add_remote(holder.local_metadata())
    with pytest.raises(InvalidTransferRequest, match=r"remote_block_ids has ids out of range \[0, 16\)"):
        reader.start_read(peer, [16], [0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_workers_of_different_tensor_parallel_sizes_refuse_each_other(backend):
    holder = create_agent(backend, "holder", make_cache(RANKS * HOLDER_BLOCKS), ranks=RANKS)
    reader = create_agent(backend, "reader", make_cache(READER_BLOCKS))
    try:
        with pytest.raises(InvalidTransferRequest, match="tensor_parallel_size") as err:
            reader.add_remote(holder.local_metadata())
        assert err.value.field == "tensor_parallel_size" and err.value.limit == 1
    finally:
        reader.close()
        holder.close()
