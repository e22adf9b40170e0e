"""KV by head between tensor-parallel sizes, at the plan level (``pdserve.kv_transfer.sharding``):
which holder ranks a reader rank reads, and the descriptors of each rank pair. The transfer is
emulated here by copying, over plain byte buffers, exactly the (address, length) descriptors
NIXL would be handed, and by head putting the staged rows in place as the NIXL backend does
(``pdserve.kv_transfer.staged``); each reader rank's cache must then equal the unsharded cache
sliced by head. Real transfers between processes: test_kv_tp_transfer.py."""

import numpy as np
import pytest
import torch
from tp_helpers import BLOCK_SIZE, HEAD_BYTES, HEADS, ROWS_PER_TOKEN, full_cache, rank_cache, tp_shard

from pdserve.kv_transfer import InvalidTransferRequest
from pdserve.kv_transfer.checksum import block_checksums, row_checksums
from pdserve.kv_transfer.layout import DRAM, CacheLayout
from pdserve.kv_transfer.metadata import publish, ranks_of
from pdserve.kv_transfer.sharding import KVShard, check_sizes, checksum_groups_for, head_slice, read_plan
from pdserve.kv_transfer.staged import coalesce, put_in_place, staging_tables
from pdserve.protos import kv_transfer_pb2

SIZES = [(1, 1), (2, 2), (2, 1), (1, 2), (2, 4), (4, 2), (4, 1), (1, 4)]


def layout_at_zero(cache: torch.Tensor) -> CacheLayout:
    return CacheLayout(0, cache[0].numel() * cache.element_size(), cache.shape[0], DRAM, 0)


def copy_descriptors(src: torch.Tensor, dst: torch.Tensor, src_t, dst_t) -> int:
    """Copy bytes as NIXL would for descriptor pairs at addresses from 0; returns the pairs."""
    assert (src_t[:, 1] == dst_t[:, 1]).all(), "a NIXL descriptor pair moves as many bytes on each side"
    s, d = src.reshape(-1).view(torch.uint8), dst.reshape(-1).view(torch.uint8)
    for (sa, n, _), (da, _, _) in zip(src_t.tolist(), dst_t.tolist()):
        d[da:da + n] = s[sa:sa + n]
    return len(src_t)


def emulate_read(src: torch.Tensor, dst: torch.Tensor, read, remote: list[int], local: list[int],
                 tail_tokens: int) -> int:
    """Move what the rank pair ``read`` moves, as the NIXL backend does: whole blocks by their
    descriptors, or by head the holder's blocks whole into staging by theirs and then each row's
    heads into place (``staged``). Returns the descriptors a side."""
    src_layout, dst_layout = layout_at_zero(src), layout_at_zero(dst)
    last_rows = tail_tokens * ROWS_PER_TOKEN
    if read.slice is None or read.slice.whole_rows:
        last = last_rows * read.holder.row_bytes
        dst_t, src_t = coalesce(dst_layout.block_descs(local, last), src_layout.block_descs(remote, last))
        return copy_descriptors(src, dst, src_t, dst_t)
    staging = torch.zeros((len(remote), src_layout.block_bytes), dtype=torch.uint8)
    dst_t, src_t = staging_tables(src_layout, remote, 0, 0, last_rows * read.slice.src_row)
    count = copy_descriptors(src, staging, src_t, dst_t)
    put_in_place(staging, dst.view(dst.shape[0], -1).view(torch.uint8), local, read.slice, last_rows)
    return count


@pytest.mark.parametrize("prefill_tp,decode_tp", SIZES)
def test_each_decode_rank_gets_exactly_its_heads_of_the_prefill_ranks(prefill_tp, decode_tp):
    full = full_cache(6, seed=7)
    before = full_cache(5, seed=8)  # what the reader's blocks held: bytes past the tail stay
    remote, local, tail = [3, 0, 5], [4, 1, 2], 3  # the last block holds 3 of its 4 tokens
    groups = checksum_groups_for(prefill_tp, decode_tp)
    holders = [tp_shard(r, prefill_tp, groups) for r in range(prefill_tp)]
    parts = set()
    for s in range(decode_tp):
        mine = rank_cache(before, s, decode_tp)
        reads = read_plan(tp_shard(s, decode_tp), holders)
        assert len(reads) == max(1, prefill_tp // decode_tp)
        for read in reads:
            emulate_read(rank_cache(full, read.holder.tp_rank, prefill_tp), mine, read, remote, local, tail)
            parts.add(read.part)
        want = rank_cache(full, s, decode_tp)
        assert torch.equal(mine[local[:2]], want[remote[:2]])
        assert torch.equal(mine[local[2], :tail], want[remote[2], :tail])
        assert torch.equal(mine[local[2], tail:], rank_cache(before, s, decode_tp)[local[2], tail:])
    assert parts == set(range(max(prefill_tp, decode_tp))) == set(range(reads[0].parts))


def test_the_single_rank_path_is_a_plain_block_read():
    (read,) = read_plan(tp_shard(0, 1), [tp_shard(0, 1)])
    assert read.slice is None and (read.part, read.parts) == (0, 1)
    (same,) = read_plan(tp_shard(1, 2), [tp_shard(0, 2), tp_shard(1, 2)])
    assert same.slice is None and same.holder.tp_rank == 1


def test_a_wider_reader_reads_a_strided_head_range_as_whole_blocks():
    """Decode TP 4 from prefill TP 2: rank 3 keeps heads [3, 4) of prefill rank 1, the second
    of its two heads, of each row, in its own whole rows; it reads the block whole, one
    descriptor, not one a row."""
    (read,) = read_plan(tp_shard(3, 4), [tp_shard(r, 2, 2) for r in range(2)])
    hs = read.slice
    assert (read.holder.tp_rank, read.start, read.stop) == (1, 3, 4)
    assert (hs.src_row, hs.src_offset, hs.dst_row, hs.dst_offset, hs.length) == (
        2 * HEAD_BYTES, HEAD_BYTES, HEAD_BYTES, 0, HEAD_BYTES)
    src, dst = rank_cache(full_cache(2, 1), 1, 2), rank_cache(full_cache(2), 3, 4)
    assert emulate_read(src, dst, read, [1], [0], BLOCK_SIZE) == 1
    assert torch.equal(dst[0], rank_cache(full_cache(2, 1), 3, 4)[1])


def test_adjacent_descriptor_pairs_merge_only_where_both_sides_run_on():
    """Pairs (local, remote, length): 0-1 run on both sides, 1-2 only locally, 2-3 only remotely,
    3-4 on both. The bytes each side names are unchanged."""
    local = np.array([[0, 4, 0], [4, 4, 0], [8, 4, 0], [100, 4, 0], [104, 2, 0]], dtype=np.uint64)
    remote = np.array([[40, 4, 0], [44, 4, 0], [0, 4, 0], [4, 4, 0], [8, 2, 0]], dtype=np.uint64)
    ours, theirs = coalesce(local, remote)
    assert ours.tolist() == [[0, 8, 0], [8, 4, 0], [100, 6, 0]]
    assert theirs.tolist() == [[40, 8, 0], [0, 4, 0], [4, 6, 0]]
    src, dst = torch.arange(64, dtype=torch.uint8), torch.zeros(128, dtype=torch.uint8)
    want = dst.clone()
    copy_descriptors(src, want, remote, local)
    copy_descriptors(src, dst, theirs, ours)
    assert torch.equal(dst, want)


def test_a_narrower_reader_reads_whole_rows_of_each_holder_into_its_slices():
    reads = read_plan(tp_shard(1, 2), [tp_shard(r, 4) for r in range(4)])
    assert [(r.holder.tp_rank, r.start, r.stop, r.part, r.parts) for r in reads] == [(2, 2, 3, 2, 4), (3, 3, 4, 3, 4)]
    assert [(r.slice.src_offset, r.slice.dst_offset, r.slice.length) for r in reads] == [
        (0, 0, HEAD_BYTES), (0, HEAD_BYTES, HEAD_BYTES)]


def test_sizes_that_do_not_divide_one_another_are_refused_naming_both():
    for holder, reader in ((2, 3), (3, 2), (4, 6)):
        with pytest.raises(InvalidTransferRequest) as err:
            check_sizes(holder, reader)
        assert f"size {holder}" in str(err.value) and f"size {reader}" in str(err.value)
        assert err.value.field == "tp_size"
    holders = [tp_shard(r, 2, heads=6) for r in range(2)]
    with pytest.raises(InvalidTransferRequest, match="tensor-parallel size 2 and the reader's \\(decode\\) size 3"):
        read_plan(tp_shard(0, 3, heads=6), holders)


@pytest.mark.parametrize("field,value", [("head_bytes", 2 * HEAD_BYTES), ("dtype", "float32"), ("block_size", 8),
                                         ("rows_per_token", 2)])
def test_caches_of_another_shape_are_refused_naming_the_field(field, value):
    holder = KVShard(**{**tp_shard(0, 1).__dict__, field: value})
    with pytest.raises(InvalidTransferRequest) as err:
        head_slice(tp_shard(0, 2), holder)
    assert err.value.field == field and repr(value) in str(err.value)


def test_a_holder_must_publish_each_of_its_ranks_once():
    with pytest.raises(InvalidTransferRequest) as err:
        read_plan(tp_shard(0, 1), [tp_shard(0, 2), tp_shard(0, 2)])
    assert err.value.field == "tp_rank"


def test_a_replicated_cache_is_read_whole_from_one_rank_spread_over_the_readers():
    """A latent cache (MLA) is the same on every rank: each reader reads one holder rank, not all."""
    holders = [KVShard.of_rank(r, 2, num_kv_heads=1, head_bytes=64, rows_per_token=2, block_size=4, dtype="bfloat16",
                               replicated=True) for r in range(2)]
    reader = KVShard.of_rank(1, 2, num_kv_heads=1, head_bytes=64, rows_per_token=2, block_size=4, dtype="bfloat16",
                             replicated=True)
    (read,) = read_plan(reader, holders)
    assert read.holder.tp_rank == 1 and read.slice is None


def test_each_pair_checks_the_holders_sums_of_the_heads_it_reads():
    """Holder TP 1 summing in 2 groups, reader TP 2: rank 1 checks group 1 of each block, and
    those sums are the reader's own sums over the heads it holds (the groups are exact)."""
    holder = tp_shard(0, 1, checksum_groups=2)
    full = full_cache(3, seed=3).view(3, -1).view(torch.uint8)
    sums = row_checksums(full, [2, 0], holder.row_bytes, 0, holder.row_bytes // 2, 2, holder.block_rows)
    (read,) = read_plan(tp_shard(1, 2), [holder])
    assert read.checksums(sums, 0, 2) == (sums[1], sums[3])
    assert read.checksums(sums, 1, 2) == (sums[3],) and read.checksums(sums, 0, 3) is None  # not summed yet
    mine = rank_cache(full_cache(3, seed=3), 1, 2).view(3, -1).view(torch.uint8)
    assert block_checksums(mine, [2, 0]) == (sums[1], sums[3])


def test_one_group_over_whole_rows_is_the_plain_block_checksum():
    blocks = full_cache(3, seed=4).view(3, -1).view(torch.uint8)
    row = HEADS * HEAD_BYTES
    assert row_checksums(blocks, [1, 2], row, 0, row, 1, 3) == block_checksums(blocks, [1, 2], 3 * row)


def test_a_reader_finer_than_the_holders_sums_is_told_the_groups_it_needs():
    (read,) = read_plan(tp_shard(3, 4), [tp_shard(r, 2) for r in range(2)])  # the holder sums whole blocks
    with pytest.raises(InvalidTransferRequest) as err:
        read.checksums((1, 2), 0, 1)
    assert (err.value.field, err.value.limit) == ("checksum_groups", 2)
    assert read.checksums((), 0, 1) is None  # no sums at all: an unverified read, as before


def rank_meta(shard: KVShard):
    return kv_transfer_pb2.AgentMetadata(agent_name=f"p-tp{shard.tp_rank}", backend="tcp", block_bytes=shard.block_bytes,
                                         num_blocks=4, shard=shard.to_proto())


def test_a_worker_publishes_its_ranks_and_a_reader_takes_them_apart_in_rank_order():
    ranks = [rank_meta(tp_shard(r, 4)) for r in range(4)]
    published = publish(ranks)
    assert published.agent_name == "p-tp0" and len(published.tp_ranks) == 3
    assert [m.shard.tp_rank for m in ranks_of(published)] == [0, 1, 2, 3]
    assert all(not m.tp_ranks for m in ranks_of(published))
    plain = kv_transfer_pb2.AgentMetadata(agent_name="old", backend="tcp", block_bytes=64, num_blocks=4)
    assert ranks_of(plain) == (plain,)  # a worker that announces no shard is one rank, read whole
    with pytest.raises(InvalidTransferRequest) as err:
        publish([ranks[0], ranks[1], ranks[1], ranks[3]])  # rank 2 missing, rank 1 twice
    assert (err.value.field, err.value.limit) == ("tp_ranks", 4)


@pytest.mark.parametrize("holders", [1, 2], ids=["whole blocks", "by head"])
def test_a_reader_that_verifies_starts_no_read_its_holder_sent_no_checksums_for(holders):
    """Fail closed (``KVSource.require_sums``): given sums (the reader verifies), they must
    cover every pair's blocks read, or nothing starts; None (the reader does not verify) passes."""
    from pdserve.kv_transfer import UnverifiedTransfer
    from pdserve.kv_transfer.source import KVSource

    reads = read_plan(tp_shard(0, 1), [tp_shard(r, holders) for r in range(holders)]) if holders > 1 else ()
    source = KVSource("p", tuple(f"p{r}" for r in range(max(1, len(reads)))), reads)
    per_block = source.sums_per_block
    source.require_sums(None, 0, 3)
    source.require_sums(tuple(range(3 * per_block)), 0, 3)  # every block's sums
    for sums, end in (((), 1), (tuple(range(2 * per_block)), 3)):  # none, or not the last block's
        with pytest.raises(UnverifiedTransfer) as err:
            source.require_sums(sums, 0, end)
        assert (err.value.field, err.value.peer) == ("verify_kv_transfers", "p")
