"""A worker's agents, one per tensor-parallel rank, driven as one (``RankAgents``): rank 0's in
its own process, each other rank's created by that rank over its own cache and driven from rank
0 over their socket pair (``RemoteAgent``; here the rank's side, ``kv_transfer.remote_agent.serve``,
runs on a thread over a cache of its own). Holder and reader workers in this process, over real NIXL (UCX) and tcp, at (prefill, decode) sizes 2 -> 2,
2 -> 1 and 1 -> 2: each reader rank holds, after the reads, exactly its heads of the holder's
cache, checked against the holder's checksums; the holder's lease ends once every part's last
read has landed, however many holder agents the notices reach; tcp's holder ranks above 0 ask
rank 0's lease table (the one guard) about block ids."""

import socket
import threading
import time

import pytest
import torch
from kv_helpers import BACKENDS
from tp_helpers import full_cache, rank_cache, tp_shard

from pdserve.kv_transfer import InvalidTransferRequest, TransferError, TransferState, create_agent
from pdserve.kv_transfer.handoff import LeaseTable, ReadNotice, ReleaseReason
from pdserve.kv_transfer.rank_agents import RankAgents, rank_agent_name
from pdserve.kv_transfer.remote_agent import RemoteAgent, serve
from pdserve.kv_transfer.sharding import checksum_groups_for

NUM_BLOCKS, SEED = 8, 99
REMOTE, LOCAL = [3, 0, 6], [1, 4, 0]


def worker(backend: str, name: str, size: int, seed: int | None, reader_tp: int = 1
           ) -> tuple[RankAgents, list[torch.Tensor]]:
    """A worker's agents over its ranks' shares of one cache (seeded, or zeros), and those shares."""
    full = full_cache(NUM_BLOCKS, seed)
    groups = checksum_groups_for(size, reader_tp)
    caches = [rank_cache(full, r, size) for r in range(size)]
    agents = [create_agent(backend, rank_agent_name(name, 0), caches[0], shard=tp_shard(0, size, groups))]
    for r in range(1, size):
        ours, theirs = socket.socketpair()
        threading.Thread(target=serve, args=(theirs, caches[r]), daemon=True).start()
        agents.append(RemoteAgent.create(ours, backend, rank_agent_name(name, r), tp_shard(r, size, groups)))
    return RankAgents(agents), caches


def until(done, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 2), (2, 1), (1, 2)])
def test_every_reader_rank_gets_its_heads_checked_and_the_lease_ends_once(backend, prefill_tp, decode_tp):
    holder, _ = worker(backend, f"prefill{prefill_tp}", prefill_tp, SEED, reader_tp=decode_tp)
    reader, reader_caches = worker(backend, f"decode{decode_tp}", decode_tp, None)
    try:
        leases, guarded = LeaseTable(), []
        lease = leases.grant("r", REMOTE, now=0.0, ttl_s=60.0)
        leases.claim(lease.token, REMOTE, now=0.0, ttl_s=60.0)
        holder.read_guard = lambda note, blocks: guarded.append(blocks) or leases.read_allowed(note, blocks)
        sums = holder.block_checksums(REMOTE)
        peer = reader.connect(holder.local_metadata())
        assert len(sums) == len(REMOTE) * peer.sums_per_block
        handles = reader.start(peer, REMOTE, LOCAL, 0, len(REMOTE), lease_token=lease.token, last=True, sums=sums)
        assert len(handles) == max(prefill_tp, decode_tp)  # one read per rank pair
        holder.expect_reads(True)
        assert all(h.checksums is not None for h in handles)  # every pair's read is verified
        for handle in handles:
            assert until(lambda: reader.poll(handle).is_terminal), "the read did not end"
            assert handle.state is TransferState.DONE, handle.error
        whole = full_cache(NUM_BLOCKS, SEED)
        for rank, cache in enumerate(reader_caches):
            want = rank_cache(whole, rank, decode_tp)
            assert torch.equal(cache[LOCAL], want[REMOTE])  # its heads of the holder's blocks, nothing else
        ended = []
        until(lambda: ended.extend(n for n in holder.get_notifications() if leases.read_ended(ReadNotice.decode(n)))
              or len(ended) > 0)
        assert len(ended) == 1  # the last part's notice ends it, whichever holder rank it reached
        assert leases.release(lease.token, ReleaseReason.PULLED) is not None
        if holder.guards_reads:  # tcp: every holder rank asked the one guard, about block ids
            reads = [sorted(b) for b in guarded if b]  # (a notice alone names no blocks)
            assert reads == [sorted(REMOTE)] * len(handles)
        assert reader.stats.snapshot().transfers == len(handles)  # one count for all the worker's ranks
    finally:
        reader.close()
        holder.close()


def test_a_rank_agents_errors_reach_rank_0_typed_and_a_gone_rank_fails_its_reads():
    """What rank r's agent refuses reaches rank 0 as the same typed error, naming the field; a
    rank whose process is gone (its end of the socket closed) fails every read of it still in
    flight, counted once in the worker's stats, and every call after."""
    with pytest.raises(InvalidTransferRequest) as bad_option:
        RemoteAgent.create(socket.socketpair()[0], "tcp", "w/tp1", None, port=5)
    assert bad_option.value.field == "port"
    holder, _ = worker("tcp", "holder", 2, SEED)
    reader, _ = worker("tcp", "reader", 2, None)
    remote = reader.agents[1]
    try:
        with pytest.raises(InvalidTransferRequest) as unknown:
            remote.start_read("nobody", [0], [0])
        assert unknown.value.field == "peer" and "reader/tp1" in str(unknown.value)
        peer = reader.connect(holder.local_metadata())
        handle = peer.sources[1].start(remote, [3], [1], 0, 1, lease_token="t", last=True)[0]
        remote._sock.close()  # as the rank's process ending: the channel closes
        assert remote.poll(handle) is TransferState.FAILED and "gone" in handle.error
        assert reader.stats.snapshot().failures == 1
        with pytest.raises(TransferError):
            remote.local_metadata()
    finally:
        reader.close()
        holder.close()
