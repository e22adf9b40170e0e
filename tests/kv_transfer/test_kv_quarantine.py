"""A NIXL read cancelled in flight, between two real OS processes: its blocks stay quarantined
until NIXL says the read is over, however long that takes, and only then are they handed out
again; a sentinel written into them then is never overwritten by the read.

UCX runs over its tcp transport here (``UCX_TLS=tcp``, in both processes): a READ over shared
memory is copied within the call that posts it, so it is never in flight; over tcp the holder
sends the bytes, so a read of 64 MiB is in flight when it is cancelled, and a holder stopped
with SIGSTOP stalls it (a read that does not end). Before the quarantine, ``cancel`` released the
NIXL transfer at once and its blocks were free: UCX wrote on into them (measured: 980 of 2048
blocks landed after the release), into whatever request had them next.
"""

import time

import pytest
import torch
from kv_helpers import Holder, make_cache

from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.errors import CacheCapacityError
from pdserve.kv_transfer import TransferState, create_agent
from pdserve.shell.read_quarantine import ReadQuarantine

pytestmark = pytest.mark.slow

BIG_BLOCK = (32, 1024)  # 64 KiB a block in bf16
NUM_BLOCKS = 1024 + 4  # a read of 1024 blocks (64 MiB), and 4 more blocks for the warm-up read
SENTINEL = -7.0


def landed(cache: torch.Tensor, blocks, expected: torch.Tensor) -> int:
    """How many of ``blocks`` hold the holder's bytes (their first and last element)."""
    ids = torch.tensor(blocks)
    got, want = cache[ids].reshape(len(blocks), -1), expected[ids].reshape(len(blocks), -1)
    return int(((got[:, 0] == want[:, 0]) & (got[:, -1] == want[:, -1])).sum())


def drive(reader, quarantine: ReadQuarantine, seconds: float) -> None:
    """Run the reader's transport (UCX progress) and the quarantine's hook for ``seconds``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        reader.get_notifications()
        quarantine.poll()
        time.sleep(0.005)


def test_a_cancelled_nixl_read_keeps_its_blocks_quarantined_until_it_is_over(monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp")  # read before the agents' UCX contexts are made (holder: at spawn)
    holder = Holder("nixl", name="quarantine-holder", num_blocks=NUM_BLOCKS, block_shape=BIG_BLOCK, seed=5)
    cache = make_cache(NUM_BLOCKS, block_shape=BIG_BLOCK)
    reader = create_agent("nixl", "quarantine-reader", cache, read_timeout_s=60)
    blocks = BlockManager(NUM_BLOCKS, block_size=1, enable_prefix_cache=False)  # the reader's block accounting
    quarantine = ReadQuarantine(reader, blocks)
    expected = holder.expected_cache()
    try:
        peer = reader.add_remote(holder.metadata())
        warm = reader.start_read(peer, [0], [NUM_BLOCKS - 1])  # UCX wires the connection up
        assert reader.wait(warm, timeout_s=30) == TransferState.DONE, warm.error
        pull = list(blocks.allocate("pull", list(range(NUM_BLOCKS - 4))).block_ids)

        handle = reader.start_read(peer, pull, pull)
        holder.pause()  # SIGSTOP: the holder sends nothing more; the read cannot end
        assert reader.poll(handle) is TransferState.TRANSFERRING  # in flight
        landing = quarantine.stop([handle])
        assert handle.state is TransferState.CANCELLED
        assert landing.handles == (handle,), "the cancel called the read over while UCX still moves it"
        blocks.free("pull", quarantine=landing.blocks)
        quarantine.hold(landing)
        at_cancel = landed(cache, pull, expected)
        assert at_cancel < len(pull)

        # A read that does not end: its blocks stay quarantined, never handed out.
        drive(reader, quarantine, 1.0)
        assert blocks.num_quarantined == len(pull) and reader.landing() == 1
        with pytest.raises(CacheCapacityError):
            blocks.allocate("next", list(range(len(pull))))

        holder.resume()
        deadline = time.monotonic() + 60
        while blocks.num_quarantined and time.monotonic() < deadline:
            drive(reader, quarantine, 0.05)
        assert blocks.num_quarantined == 0 and reader.landing() == 0, "the read never ended after SIGCONT"
        # The read wrote on after its cancel, to its end: released at the cancel, these bytes
        # would have landed in the next request's KV.
        assert landed(cache, pull, expected) == len(pull) > at_cancel

        # Reused only now: a sentinel written there stays, however long the transport runs.
        assert set(pull) <= set(blocks.allocate("next", list(range(NUM_BLOCKS))).block_ids)  # every block
        cache[torch.tensor(pull)] = SENTINEL
        drive(reader, quarantine, 1.0)
        assert bool((cache[torch.tensor(pull)] == SENTINEL).all())
        blocks.check_invariants()
        assert reader.stats.snapshot().cancels == 1
    finally:
        holder.resume()
        reader.close()
        holder.stop()
