"""Reads between two real OS processes over real NIXL (UCX) and tcp: the holder process owns
a cache with known contents, this process reads chosen blocks into other positions."""

import time

import pytest
import torch
from kv_helpers import BACKENDS, BLOCK_BYTES, Holder, make_cache, same_bytes

from pdserve.kv_transfer import TransferState, create_agent


def test_read_lands_exact_bytes_in_chosen_blocks_and_notifies_holder(holder, reader):
    peer = reader.add_remote(holder.metadata())
    remote, local = [3, 0, 15, 4], [10, 1, 5, 2]
    handle = reader.start_read(peer, remote, local, b"req-7:lease-1")
    assert reader.wait(handle, timeout_s=10) == TransferState.DONE, handle.error

    expected = holder.expected_cache()
    assert same_bytes(reader.cache[local], expected[remote])
    untouched = [i for i in range(12) if i not in local]
    assert same_bytes(reader.cache[untouched], make_cache(12)[untouched])
    assert holder.notifications(want=1) == [b"req-7:lease-1"]

    stats = reader.stats.snapshot()
    assert (stats.bytes, stats.transfers, stats.failures) == (4 * BLOCK_BYTES, 1, 0)
    assert stats.seconds > 0


def test_partial_last_block_moves_only_its_bytes(holder, reader):
    peer = reader.add_remote(holder.metadata())
    remote, local, tail = [2, 9, 6], [4, 7, 11], BLOCK_BYTES // 3
    handle = reader.start_read(peer, remote, local, b"partial", last_block_bytes=tail)
    assert reader.wait(handle, timeout_s=10) == TransferState.DONE, handle.error
    expected, before = holder.expected_cache(), make_cache(12)
    assert same_bytes(reader.cache[local[:2]], expected[remote[:2]])
    got = reader.cache[local[2]].reshape(-1).view(torch.uint8)
    assert torch.equal(got[:tail], expected[remote[2]].reshape(-1).view(torch.uint8)[:tail])
    assert torch.equal(got[tail:], before[local[2]].reshape(-1).view(torch.uint8)[tail:])  # untouched
    assert reader.stats.snapshot().bytes == 2 * BLOCK_BYTES + tail
    assert holder.notifications(want=1) == [b"partial"]


def test_stats_accumulate_over_reads_including_adjacent_runs(holder, reader):
    peer = reader.add_remote(holder.metadata())
    # Adjacent ids on both sides (NIXL may merge them) and a full-cache-sized read.
    reads = [([5, 6, 7], [0, 1, 2], b"a"), (list(range(12)), list(range(11, -1, -1)), b"b")]
    for remote, local, note in reads:
        handle = reader.start_read(peer, remote, local, note)
        assert reader.wait(handle, timeout_s=10) == TransferState.DONE, handle.error
        assert same_bytes(reader.cache[local], holder.expected_cache()[remote])
    assert sorted(holder.notifications(want=2)) == [b"a", b"b"]
    stats = reader.stats.snapshot()
    assert (stats.bytes, stats.transfers) == (15 * BLOCK_BYTES, 2)


def test_add_remote_is_idempotent(holder, reader):
    first = reader.add_remote(holder.metadata())
    assert reader.add_remote(holder.metadata()) == first == holder.name
    handle = reader.start_read(first, [1], [1], b"")
    assert reader.wait(handle, timeout_s=10) == TransferState.DONE, handle.error


def test_cancel_of_delayed_read_moves_nothing_and_counts_nothing(holder):
    reader = create_agent(holder.backend, "slow-reader", make_cache(4), inject_delay_s=30)
    try:
        peer = reader.add_remote(holder.metadata())
        handle = reader.start_read(peer, [2], [0], b"never")
        assert reader.poll(handle) == TransferState.PENDING
        assert reader.cancel(handle) == TransferState.CANCELLED
        assert reader.poll(handle) == TransferState.CANCELLED
        assert reader.in_flight() == 0
        assert same_bytes(reader.cache, make_cache(4))
        stats = reader.stats.snapshot()
        assert (stats.bytes, stats.transfers, stats.cancels) == (0, 0, 1)
        assert holder.notifications(want=1, timeout_s=0.3) == []
    finally:
        reader.close()


def test_inject_delay_holds_completion_back(holder):
    reader = create_agent(holder.backend, "delayed-reader", make_cache(4), inject_delay_s=0.3)
    try:
        peer = reader.add_remote(holder.metadata())
        start = time.monotonic()
        handle = reader.start_read(peer, [9], [3], b"late")
        assert reader.poll(handle) == TransferState.PENDING
        assert reader.wait(handle, timeout_s=10) == TransferState.DONE, handle.error
        assert time.monotonic() - start >= 0.3
        assert reader.stats.snapshot().seconds >= 0.3
        assert holder.notifications(want=1) == [b"late"]
    finally:
        reader.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_vanished_peer_fails_fast_and_its_restart_is_readable_again(backend):
    doomed = Holder(backend, name="doomed")
    reader = create_agent(backend, "survivor", make_cache(4), read_timeout_s=5)
    reborn = None
    try:
        peer = reader.add_remote(doomed.metadata())
        warm = reader.start_read(peer, [0], [0], b"")
        assert reader.wait(warm, timeout_s=10) == TransferState.DONE, warm.error
        doomed.kill()
        start = time.monotonic()
        handle = reader.start_read(peer, [1, 2], [1, 2], b"lost")
        assert reader.wait(handle, timeout_s=10) == TransferState.FAILED
        assert time.monotonic() - start < 6  # bounded by read_timeout_s, not a hang
        assert handle.error
        stats = reader.stats.snapshot()
        assert (stats.failures, stats.transfers, stats.bytes) == (1, 1, BLOCK_BYTES)

        # The worker restarts under the same name with new metadata (new address, cache).
        reborn = Holder(backend, name="doomed", seed=99)
        assert reader.add_remote(reborn.metadata()) == peer
        again = reader.start_read(peer, [5, 6], [1, 2], b"again")
        assert reader.wait(again, timeout_s=10) == TransferState.DONE, again.error
        assert same_bytes(reader.cache[[1, 2]], reborn.expected_cache()[[5, 6]])
        assert reborn.notifications(want=1) == [b"again"]
    finally:
        reader.close()
        doomed.stop()
        if reborn is not None:
            reborn.stop()


def test_stalled_tcp_holder_times_out_and_in_flight_cancel_is_prompt():
    # tcp needs the holder's CPU to serve bytes, so a SIGSTOPped holder stalls the read.
    # (A NIXL READ over UCX shared memory is one-sided and completes anyway.)
    stalled = Holder("tcp", name="stalled")
    reader = create_agent("tcp", "patient", make_cache(4), read_timeout_s=0.5)
    try:
        peer = reader.add_remote(stalled.metadata())
        stalled.pause()
        timed_out = reader.start_read(peer, [0], [0], b"timed-out")
        assert reader.wait(timed_out, timeout_s=5) == TransferState.FAILED
        assert "read_timeout_s" in timed_out.error

        in_flight = reader.start_read(peer, [1], [1], b"cancelled")
        time.sleep(0.05)
        assert reader.poll(in_flight) == TransferState.TRANSFERRING
        start = time.monotonic()
        assert reader.cancel(in_flight) == TransferState.CANCELLED
        assert time.monotonic() - start < 1
        stalled.resume()
        assert stalled.notifications(want=1, timeout_s=0.5) == []
        stats = reader.stats.snapshot()
        assert (stats.failures, stats.cancels, stats.transfers, stats.bytes) == (1, 1, 0, 0)
        assert same_bytes(reader.cache, make_cache(4))
    finally:
        stalled.resume()
        reader.close()
        stalled.stop()
