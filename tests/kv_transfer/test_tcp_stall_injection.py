"""The tcp backend's test-only stalls (used by tests/conformance): a holder that accepts a read
and never sends, and a reader that never receives. Each read fails at ``read_timeout_s`` with
the reason, nothing lands in the reader's blocks, the stalled thread ends with the read, and
the same agents read normally once the stall is off."""

import threading
import time

import pytest
from kv_helpers import make_cache, same_bytes

from pdserve.kv_transfer import TransferState, create_agent

TIMEOUT_S = 0.5


@pytest.fixture
def pair():
    holder = create_agent("tcp", "holder", make_cache(4, seed=7))
    reader = create_agent("tcp", "reader", make_cache(4), read_timeout_s=TIMEOUT_S)
    try:
        yield holder, reader, reader.add_remote(holder.local_metadata())
    finally:
        reader.close()
        holder.close()


def stalled_read(holder, reader, peer) -> tuple[TransferState, float]:
    threads = threading.active_count()
    start = time.monotonic()
    handle = reader.start_read(peer, [1, 2], [0, 1])
    state = reader.wait(handle, timeout_s=10)
    took = time.monotonic() - start
    assert state == TransferState.FAILED, state
    assert "read_timeout_s" in handle.error or "timed out" in handle.error, handle.error
    assert same_bytes(reader.cache[:2], make_cache(4)[:2])  # nothing landed
    deadline = time.monotonic() + 5
    while threading.active_count() > threads + 1 and time.monotonic() < deadline:  # +1: a pool thread stays
        time.sleep(0.05)
    assert threading.active_count() <= threads + 1, "a stalled thread outlived its read"
    return state, took


@pytest.mark.parametrize("side", ["holder", "reader"])
def test_a_stalled_read_fails_at_its_timeout_and_the_agents_read_again_after(pair, side):
    holder, reader, peer = pair
    agent = holder if side == "holder" else reader
    setattr(agent, f"inject_{side}_stall", True)
    _, took = stalled_read(holder, reader, peer)
    assert TIMEOUT_S <= took < TIMEOUT_S + 3, took
    assert reader.stats.snapshot().failures == 1
    setattr(agent, f"inject_{side}_stall", False)
    handle = reader.start_read(peer, [1, 2], [0, 1])
    assert reader.wait(handle, timeout_s=10) == TransferState.DONE, handle.error
    assert same_bytes(reader.cache[:2], holder.cache[1:3])
