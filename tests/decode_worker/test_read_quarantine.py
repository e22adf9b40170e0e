"""A decode worker whose KV read hangs, then is aborted: the prompt's blocks stay quarantined,
counted in its Stats (``kv_quarantined_blocks``, the gauge ``pdserve:kv_quarantined_blocks``),
until the read is over, and only then are they free. A real decode worker (tiny model, its
engine thread) reading over real NIXL from a holder in another OS process, stopped with SIGSTOP
before the read is posted; UCX over its tcp transport, where a holder that does not run sends
nothing (``tests/kv_transfer/test_kv_quarantine.py`` says why)."""

import asyncio
import time

import pytest

from pdserve.decode_worker.worker import DecodeWorker
from pdserve.engine.sampling.params import SamplingParams
from pdserve.kv_transfer import TransferState
from pdserve.kv_transfer.handoff import KVHandle
from tests.factories import decode_worker_config, make_engine
from tests.kv_transfer.kv_helpers import Holder

pytestmark = pytest.mark.slow

BLOCKS, BLOCK = 16, 16
PROMPT = list(range(1, 41))  # 3 blocks


async def until(check, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return check()


def test_an_aborted_request_whose_read_hangs_keeps_its_blocks_until_the_read_is_over(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp")
    # verify_kv off: the handle below carries no checksums, and a reader that verifies refuses
    # such KV unread (test_unverified_refused.py); here the read must be posted and hang.
    decoder = DecodeWorker(decode_worker_config(kv_transfer_backend="nixl", transfer_timeout_s=60, verify_kv=False),
                           engine=make_engine(tiny_llama_dir[0], num_blocks=BLOCKS, enable_prefix_cache=False))
    agent = decoder.agent.agents[0]
    holder = Holder("nixl", name="hung-holder", num_blocks=BLOCKS, block_shape=(agent.layout.block_bytes // 2,))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    async def claim() -> None:
        return None

    async def main():
        peer = decoder.add_peer(holder.metadata())
        warm = agent.start_read(peer.sources[0].peers[0], [0], [BLOCKS - 1])  # UCX wires the connection up
        assert agent.wait(warm, timeout_s=30) == TransferState.DONE, warm.error
        holder.pause()
        kv = KVHandle("holder:0", (4, 5, 6), len(PROMPT), "lease-token")
        stream = decoder.decode("r", PROMPT, 7, params, kv, peer, claim)
        first = asyncio.create_task(anext(stream))
        assert await until(lambda: agent.in_flight() == 1, 30)  # the read is posted; it cannot end
        first.cancel()  # the caller gives up: the request is aborted, its read cancelled
        with pytest.raises(asyncio.CancelledError):
            await first
        after_abort = decoder.stats()
        await asyncio.sleep(1.0)  # the engine thread's hooks run on
        held = decoder.stats()
        holder.resume()
        released = await until(lambda: decoder.stats().kv_quarantined_blocks == 0, 60)
        return after_abort, held, released, decoder.engine.blocks.num_free_blocks

    decoder.start()
    try:
        after_abort, held, released, free_blocks = asyncio.run(main())
    finally:
        holder.resume()
        decoder.stop()
        holder.stop()
    assert after_abort.kv_quarantined_blocks == held.kv_quarantined_blocks == 3
    assert held.num_blocks_used == 3 and held.num_running == 0  # the request is gone; its blocks are not free
    assert released and free_blocks == BLOCKS
