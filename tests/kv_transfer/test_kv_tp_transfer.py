"""KV by head between workers of different tensor-parallel sizes, over real NIXL (UCX) and tcp
between OS processes. Ranks are emulated (no TP runtime here): each prefill rank is an agent in
its own process over its own cache, holding its heads of one seeded cache; each decode rank is
an agent of its own in this process, over a cache tensor of its own. Each decode rank connects
to what the prefill worker publishes (``KVSource.connect``) and starts its reads (one per rank
pair); its blocks must then equal the unsharded cache sliced by its heads, as if it had computed
the prompt itself. The lease ends only once every pair's last read has landed."""

import time

import pytest
import torch
from kv_helpers import BACKENDS, Holder
from tp_helpers import ROWS_PER_TOKEN, full_cache, rank_agent, rank_cache, shard_args, tp_shard, worker_checksums

from pdserve.kv_transfer import InvalidTransferRequest, TransferState
from pdserve.kv_transfer.handoff import LeaseTable, ReadNotice
from pdserve.kv_transfer.metadata import publish
from pdserve.kv_transfer.sharding import KVShard
from pdserve.kv_transfer.source import KVSource

NUM_BLOCKS, SEED = 8, 4242
REMOTE, LOCAL = [3, 0, 6, 5], [1, 4, 0, 2]


class PrefillWorker:
    """The prefill ranks of one worker (a process each) and what the worker publishes."""

    def __init__(self, backend: str, size: int, checksum_groups: int):
        self.size, self.holders = size, []
        try:
            for r in range(size):
                shard = shard_args(tp_shard(r, size, checksum_groups))
                self.holders.append(Holder(backend, f"prefill{size}-tp{r}", NUM_BLOCKS, SEED, shard))
        except BaseException:
            self.stop()
            raise
        self.published = publish([h.metadata() for h in self.holders])

    def notices(self, want: int, timeout_s: float = 5.0) -> list[bytes]:
        """Every rank's notifications, waiting up to ``timeout_s`` for ``want`` (a TP runtime
        forwards them to rank 0's lease table)."""
        got: list[bytes] = []
        deadline = time.monotonic() + timeout_s
        while len(got) < want and time.monotonic() < deadline:
            for h in self.holders:
                got += h.notifications(0, 0)
            time.sleep(0.01)
        return got

    def tail_bytes(self, tokens: int):
        """The bytes each rank sums of a last block holding ``tokens`` tokens."""
        return lambda r: tokens * ROWS_PER_TOKEN * KVShard.from_proto(self.holders[r].metadata().shard).row_bytes

    def stop(self) -> None:
        for h in self.holders:
            h.stop()


@pytest.fixture(scope="module", params=BACKENDS)
def prefill(request):
    """Prefill TP 1 (summing in 2 groups, so that decode TP 2 can check its halves) and TP 2."""
    workers = {}
    try:
        workers[1] = PrefillWorker(request.param, 1, checksum_groups=2)
        workers[2] = PrefillWorker(request.param, 2, checksum_groups=1)
        yield request.param, workers
    finally:
        for w in workers.values():
            w.stop()


def decode_ranks(backend: str, size: int, tag: str):
    return [rank_agent(backend, f"decode{size}-{tag}-tp{s}", 6, None, tp_shard(s, size)) for s in range(size)]


def read_all(ranks, published, token: str, sums, tail_tokens: int, spans=((0, 4),)):
    """Every decode rank reads blocks in ``spans`` (the last one ending the lease), as a decode
    worker's ranks would; returns each rank's handles."""
    out = []
    for agent in ranks:
        source = KVSource.connect(agent, published)
        tail = tail_tokens * ROWS_PER_TOKEN * agent.shard.row_bytes
        handles = []
        for start, end in spans:
            last = end == len(REMOTE)
            handles += source.start(agent, REMOTE, LOCAL, start, end, lease_token=token, last=last,
                                    last_block_bytes=tail if last else None, sums=sums)
        for h in handles:
            assert agent.wait(h, timeout_s=15) == TransferState.DONE, h.error
        out.append(handles)
    return out


def assert_holds_its_heads(ranks, tail_tokens: int) -> None:
    full = full_cache(NUM_BLOCKS, SEED)
    for s, agent in enumerate(ranks):
        want = rank_cache(full, s, len(ranks))
        assert torch.equal(agent.cache[LOCAL[:-1]], want[REMOTE[:-1]]), f"decode rank {s}"
        assert torch.equal(agent.cache[LOCAL[-1], :tail_tokens], want[REMOTE[-1], :tail_tokens])
        assert not agent.cache[LOCAL[-1], tail_tokens:].any()  # past the prompt: not moved


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2), (2, 2), (1, 1)])
def test_each_decode_rank_holds_its_heads_after_the_transfer_and_the_lease_ends_once(prefill, prefill_tp, decode_tp):
    backend, workers = prefill
    worker = workers[prefill_tp]
    ranks = decode_ranks(backend, decode_tp, "whole")
    table = LeaseTable()
    lease = table.grant("req", REMOTE, 0.0, 30.0)
    tail = 3
    try:
        sums = worker_checksums(worker.holders, REMOTE, worker.tail_bytes(tail))
        handles = read_all(ranks, worker.published, lease.token, sums, tail)
        assert_holds_its_heads(ranks, tail)
        assert all(h.checksums is not None for hs in handles for h in hs)  # every pair was verified
        if prefill_tp == decode_tp:  # whole blocks, one descriptor each (TP 1 sums in halves: checked so)
            assert all(h.descriptors == len(REMOTE) and (h.slice is None) == (prefill_tp == 2)
                       for hs in handles for h in hs)
        pairs = max(prefill_tp, decode_tp)
        notes = worker.notices(pairs)
        assert len(notes) == pairs
        ended = [table.read_ended(ReadNotice.decode(n)) for n in notes]
        assert ended == [False] * (pairs - 1) + [True]  # the lease ends with the last pair's read only
    finally:
        for agent in ranks:
            agent.close()


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2)])
def test_streamed_kv_moves_by_head_chunk_by_chunk(prefill, prefill_tp, decode_tp):
    """Early reads of the blocks finished so far, then the rest with the lease's end: the same
    bytes as one read, and only the last reads' notices end the lease."""
    backend, workers = prefill
    worker = workers[prefill_tp]
    ranks = decode_ranks(backend, decode_tp, "stream")
    table = LeaseTable()
    lease = table.grant("req", REMOTE, 0.0, 30.0)
    try:
        sums = worker_checksums(worker.holders, REMOTE, worker.tail_bytes(2))
        read_all(ranks, worker.published, lease.token, sums, 2, spans=((0, 1), (1, 3), (3, 4)))
        assert_holds_its_heads(ranks, 2)
        notes = [ReadNotice.decode(n) for n in worker.notices(max(prefill_tp, decode_tp) * (3 if backend == "tcp" else 1))]
        last = [n for n in notes if n.ends_lease]
        assert len(last) == max(prefill_tp, decode_tp)  # early reads notify only a holder that serves them (tcp)
        assert [table.read_ended(n) for n in notes].count(True) == 1 and table.read_ended(last[-1])
    finally:
        for agent in ranks:
            agent.close()


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2)])
def test_a_nixl_read_by_head_moves_whole_blocks_in_chunks_one_descriptor_a_run_of_adjacent_ones(
        prefill, prefill_tp, decode_tp):
    """Staged (``pdserve.kv_transfer.staged``): the holder's blocks whole into a staging buffer of
    two chunks of two blocks here, then each row's heads into place. Adjacent holder blocks make
    one descriptor, scattered ones one each; the bytes equal the unsharded cache's, past the tail
    nothing lands, every pair is verified, and each pair's holder hears once, from its last chunk.
    One buffer an agent: at 2:1 the second pair's read waits for the first's buffer."""
    backend, workers = prefill
    if backend != "nixl":
        pytest.skip("tcp moves a read by head as one stream of rows, with no descriptors to merge")
    worker = workers[prefill_tp]
    holder_block = KVShard.from_proto(worker.holders[0].metadata().shard).block_bytes
    ranks = [rank_agent(backend, f"decode{decode_tp}-staged-tp{s}", 6, None, tp_shard(s, decode_tp),
                        staging_bytes=4 * holder_block, staging_buffers=1) for s in range(decode_tp)]
    full, tail = full_cache(NUM_BLOCKS, SEED), 3
    table = LeaseTable()
    try:
        for remote, local, descriptors in (([4, 5, 6, 7], [5, 1, 0, 3], 2), ([3, 0, 6, 5], [1, 4, 0, 2], 4)):
            lease = table.grant(f"req{remote[0]}", remote, 0.0, 30.0)
            sums = worker_checksums(worker.holders, remote, worker.tail_bytes(tail))
            for s, agent in enumerate(ranks):
                agent.cache.zero_()
                source = KVSource.connect(agent, worker.published)
                last = tail * ROWS_PER_TOKEN * agent.shard.row_bytes
                handles = source.start(agent, remote, local, 0, len(remote), lease_token=lease.token, last=True,
                                       last_block_bytes=last, sums=sums)
                assert [agent.wait(h, timeout_s=15) for h in handles] == [TransferState.DONE] * len(handles)
                assert [h.descriptors for h in handles] == [descriptors] * len(handles)
                want = rank_cache(full, s, decode_tp)
                assert torch.equal(agent.cache[local[:-1]], want[remote[:-1]])
                assert torch.equal(agent.cache[local[-1], :tail], want[remote[-1], :tail])
                assert not agent.cache[local[-1], tail:].any()
            pairs = max(prefill_tp, decode_tp)
            notes = [ReadNotice.decode(n) for n in worker.notices(pairs)]
            assert len(notes) == pairs and all(n.ends_lease for n in notes)
            assert [table.read_ended(n) for n in notes] == [False] * (pairs - 1) + [True]
    finally:
        for agent in ranks:
            agent.close()


@pytest.mark.parametrize("prefill_tp,decode_tp,flip_rank,offset,failing", [
    (2, 1, 1, 5, {0: [1]}),    # decode rank 0 reads both prefill ranks: only the pair with rank 1 fails
    (1, 2, 0, 40, {1: [0]}),   # byte 40 of a row is head 2's: decode rank 1's; rank 0's heads are intact
])
def test_a_changed_byte_fails_the_pair_that_read_it_naming_the_block_and_the_peer(
        prefill, prefill_tp, decode_tp, flip_rank, offset, failing):
    backend, workers = prefill
    worker = workers[prefill_tp]
    ranks = decode_ranks(backend, decode_tp, f"verify{flip_rank}")
    holder = worker.holders[flip_rank]
    sums = worker_checksums(worker.holders, REMOTE[:2])
    holder.flip(REMOTE[1], offset)  # after the sums were taken: the read carries the changed byte
    try:
        for s, agent in enumerate(ranks):
            source = KVSource.connect(agent, worker.published)
            handles = source.start(agent, REMOTE, LOCAL, 0, 2, lease_token="t", last=False, sums=sums)
            states = [agent.wait(h, timeout_s=15) for h in handles]
            bad = [i for i, state in enumerate(states) if state is TransferState.FAILED]
            assert bad == failing.get(s, []), [h.error for h in handles]
            for i in bad:
                assert handles[i].verify_failed
                assert f"block {REMOTE[1]} of peer '{holder.name}'" in handles[i].error
    finally:
        holder.flip(REMOTE[1], offset)
        for agent in ranks:
            agent.close()


def test_a_decode_size_that_does_not_divide_the_prefill_size_is_refused_naming_both(prefill):
    backend, workers = prefill
    agent = rank_agent(backend, "decode3-tp0", 6, None, tp_shard(0, 3, heads=6))
    published = workers[2].published
    try:
        with pytest.raises(InvalidTransferRequest) as err:
            KVSource.connect(agent, published)
        assert "size 2" in str(err.value) and "size 3" in str(err.value)
    finally:
        agent.close()
