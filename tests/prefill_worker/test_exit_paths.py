"""Every way a request leaves a prefill worker ends in ``forget``: afterwards the worker has no
record of it, no lease on its KV, and every block is free. No fault strands a block.

The worker runs in this process with its engine thread and a tcp KV agent, no gRPC server; a
second tcp agent stands in for the decode worker's reads. A gate on the engine's step lets a
test hold a prompt between two chunks, so each path is taken on purpose, not by timing."""

import asyncio
import contextlib
import threading

import pytest
import torch

from pdserve.engine.errors import SequenceFailed
from pdserve.engine.sampling.params import SamplingParams
from pdserve.kv_transfer import TransferState, create_agent
from pdserve.kv_transfer.handoff import Lease, ReadNotice, ReleaseReason
from pdserve.prefill_worker.kv_stream import KVEarly, KVLeaseEnded
from pdserve.prefill_worker.worker import PrefillWorker
from tests.factories import make_engine, nan_logits_for, prefill_worker_config, random_prompts

pytestmark = pytest.mark.slow

CHUNK = 32
PROMPT = random_prompts(1, [100], seed=31)[0]  # 7 blocks of 16, computed in 4 chunks of CHUNK
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


class StepGate:
    """Holds the engine before each step until the test lets it go: ``allow`` one step, or
    ``open`` for good. Calls queued for the engine thread run only between steps."""

    def __init__(self, engine):
        self._permits = threading.Semaphore(0)
        self._open = threading.Event()
        step = engine.step

        def gated_step():
            while not self._open.is_set() and not self._permits.acquire(timeout=0.01):
                pass
            return step()

        engine.step = gated_step

    def allow(self, steps: int = 1) -> None:
        self._permits.release(steps)

    def open(self) -> None:
        self._open.set()


@contextlib.asynccontextmanager
async def worker(tiny_llama_dir, gated: bool = False, **config):
    """A started prefill worker (tcp agent, chunks of CHUNK tokens, no prefix cache: a freed
    block counts as free) and, with ``gated``, the gate on its steps (else an open one)."""
    engine = make_engine(tiny_llama_dir[0], num_blocks=32, max_num_batched_tokens=CHUNK, enable_prefix_cache=False)
    gate = StepGate(engine)
    if not gated:
        gate.open()
    w = PrefillWorker(prefill_worker_config(kv_transfer_backend="tcp", **config), engine=engine)
    w.start()
    try:
        yield w, gate
    finally:
        gate.open()
        w.stop()


async def settle(w: PrefillWorker) -> None:
    """Wait for what the engine thread was asked to do (a forget after a call ended)."""
    await w.call(lambda: None)


async def assert_left_nothing(w: PrefillWorker, timeout_s: float = 10.0) -> None:
    """The worker forgets every request and frees every block (within ``timeout_s``: a lease
    ends on the engine thread's next poll)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while (w.records or len(w.leases)) and loop.time() < deadline:
        await asyncio.sleep(0.02)
    await settle(w)
    blocks = w.engine.blocks
    assert w.records == {} and len(w.leases) == 0
    assert w.engine.num_held == 0 and not w.engine.has_unfinished()
    assert blocks.num_free_blocks == blocks.num_blocks


async def streamed_until_lease(w: PrefillWorker, gate: StepGate, request_id: str):
    """A streamed prompt held after its first chunk: (its stream, the early lease)."""
    stream = w.prefill_stream(request_id, PROMPT, GREEDY, stream_kv=True)
    gate.allow(1)
    early = await stream.__anext__()
    assert isinstance(early, KVEarly) and early.ready_tokens == CHUNK
    return stream, early.lease


def pull(w: PrefillWorker, lease: Lease, ends_lease: bool = True, num_tokens: int | None = None) -> TransferState:
    """Read the lease's blocks as a decode worker would (claimed first), with its notice;
    with ``num_tokens`` (the tokens they hold), only those, checked against the lease's checksums."""
    with create_agent("tcp", "reader", torch.zeros_like(w.engine.kv_cache)) as reader:
        peer = reader.add_remote(w.agent.local_metadata())
        ids, last, sums = list(lease.block_ids), None, None
        if num_tokens is not None:
            last = w.engine.cache_spec.tail_bytes(num_tokens - (len(ids) - 1) * w.engine.blocks.block_size)
            sums = lease.checksums
        handle = reader.start_read(peer, ids, ids, notify=ReadNotice(lease.token, ends_lease).encode(),
                                   last_block_bytes=last, checksums=sums)
        return reader.wait(handle, 10)


def test_a_prompt_pulled_by_its_decode_worker(tiny_llama_dir):
    async def main():
        async with worker(tiny_llama_dir) as (w, _):
            result = await w.prefill("pulled#0", PROMPT, GREEDY)
            assert w.records["pulled#0"].lease is result.lease  # HELD: the record outlives the call
            await w.claim(result.lease.token, list(result.lease.block_ids))
            assert await asyncio.to_thread(pull, w, result.lease) is TransferState.DONE
            await assert_left_nothing(w)
            return w.leases.released_by

    assert asyncio.run(main())["pulled"] == 1


def test_a_streamed_prompt_pulled_early_then_last(tiny_llama_dir):
    async def main():
        async with worker(tiny_llama_dir, gated=True) as (w, gate):
            stream, lease = await streamed_until_lease(w, gate, "streamed#0")
            await w.claim(lease.token, list(lease.block_ids))
            gate.open()
            async for item in stream:
                result = item
            assert result.lease is lease and await asyncio.to_thread(pull, w, lease, False) is TransferState.DONE
            assert len(w.leases) == 1  # an early read leaves the lease held
            assert await asyncio.to_thread(pull, w, lease) is TransferState.DONE
            await assert_left_nothing(w)

    asyncio.run(main())


@pytest.mark.parametrize("claimed", [False, True])
def test_a_lease_nobody_pulls_expires(tiny_llama_dir, claimed):
    async def main():
        async with worker(tiny_llama_dir, lease_seconds=0.3) as (w, _):
            result = await w.prefill("expires#0", PROMPT, GREEDY)
            if claimed:  # a reader that claimed, then handed it back unread (RETURNED)
                await w.claim(result.lease.token, list(result.lease.block_ids))
                assert await w.release(result.lease.token, ReleaseReason.RETURNED)
                assert w.records["expires#0"].lease is result.lease and len(w.leases) == 1
            await assert_left_nothing(w)
            return w.leases.released_by

    released_by = asyncio.run(main())
    assert released_by["expired"] == 1 and released_by["returned"] == int(claimed)


def test_unclaimed_kv_of_a_router_that_died(tiny_llama_dir):
    async def main():
        async with worker(tiny_llama_dir, owner_timeout_s=0.3) as (w, _):
            await w.prefill("orphan#0", PROMPT, GREEDY, owner="router-1")
            await assert_left_nothing(w)
            return w.leases.released_by

    assert asyncio.run(main())["owner_lost"] == 1


@pytest.mark.parametrize("reason", [ReleaseReason.ABORTED, ReleaseReason.TRANSFER_FAILED])
def test_a_lease_the_decode_side_releases(tiny_llama_dir, reason):
    async def main():
        async with worker(tiny_llama_dir) as (w, _):
            result = await w.prefill("released#0", PROMPT, GREEDY)
            await w.claim(result.lease.token, list(result.lease.block_ids))
            assert await w.release(result.lease.token, reason)
            assert not await w.release(result.lease.token, reason)  # once
            await assert_left_nothing(w)

    asyncio.run(main())


def test_a_streamed_transfer_that_fails_while_the_prompt_computes_stops_the_prompt(tiny_llama_dir):
    async def main():
        async with worker(tiny_llama_dir, gated=True) as (w, gate):
            stream, lease = await streamed_until_lease(w, gate, "failed#0")
            await w.claim(lease.token, list(lease.block_ids))
            released = asyncio.ensure_future(w.release(lease.token, ReleaseReason.TRANSFER_FAILED))
            gate.open()  # the release runs after the step held at the gate: chunk 2 of 4
            assert await released
            with pytest.raises(KVLeaseEnded):
                async for _ in stream:
                    pass
            await assert_left_nothing(w)

    asyncio.run(main())


@pytest.mark.parametrize("when", ["queued", "streamed", "during_the_last_chunk"])
def test_a_caller_that_gives_up_mid_prompt(tiny_llama_dir, when):
    """Cancelled while queued, while its streamed lease is out, or while the step that samples
    its first token runs (the step ends before the forget queued for it runs)."""
    async def main():
        async with worker(tiny_llama_dir, gated=True) as (w, gate):
            if when == "streamed":
                stream, _ = await streamed_until_lease(w, gate, "gone#0")
                await stream.aclose()
            else:
                call = asyncio.ensure_future(w.prefill("gone#0", PROMPT, GREEDY))
                while not w.engine.has_unfinished():
                    await asyncio.sleep(0.01)
                if when == "during_the_last_chunk":
                    gate.allow(3)
                    while w.engine.prompt_progress("gone#0") != 3 * CHUNK:  # then held before the 4th
                        await asyncio.sleep(0.01)
                call.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await call
            gate.open()
            await assert_left_nothing(w)
            return w.leases.released_by

    released_by = asyncio.run(main())
    assert released_by["aborted"] == (when == "streamed")  # no lease is granted to a caller that left


def test_a_prompt_that_ends_at_its_first_token_or_fails_holds_nothing(tiny_llama_dir):
    async def main():
        async with worker(tiny_llama_dir) as (w, _):
            done = await w.prefill("one#0", PROMPT, SamplingParams(max_tokens=1, temperature=0.0))
            assert done.lease is None and done.finish_reason is not None
            nan_logits_for(w.engine, "bad#0")
            with pytest.raises(SequenceFailed):
                await w.prefill("bad#0", PROMPT, GREEDY)
            await assert_left_nothing(w)

    asyncio.run(main())


def test_a_draining_worker_ends_with_nothing_held(tiny_llama_dir):
    """A drain waits for the prompt computing and for the KV held for decode workers; each
    leaves by its own path (pulled, released), and then the worker is empty."""
    async def main():
        async with worker(tiny_llama_dir, gated=True) as (w, gate):
            gate.allow(4)
            held = await w.prefill("held#0", PROMPT, GREEDY)
            computing = asyncio.ensure_future(w.prefill("computing#0", PROMPT, GREEDY))
            while "computing#0" not in w.records:
                await asyncio.sleep(0.01)
            drained = asyncio.ensure_future(w.drain(30.0))
            gate.open()
            other = await computing
            await w.claim(held.lease.token, list(held.lease.block_ids))
            assert await asyncio.to_thread(pull, w, held.lease) is TransferState.DONE
            assert await w.release(other.lease.token, ReleaseReason.ABORTED)
            assert await drained
            await assert_left_nothing(w)

    asyncio.run(main())


def test_a_request_id_in_use_is_refused_without_touching_the_request_that_has_it(tiny_llama_dir):
    async def main():
        async with worker(tiny_llama_dir) as (w, _):
            first = await w.prefill("same#0", PROMPT, GREEDY)
            with pytest.raises(ValueError, match="already in use"):
                await w.prefill("same#0", PROMPT, GREEDY)
            assert w.records["same#0"].lease is first.lease and len(w.leases) == 1
            assert await w.release(first.lease.token, ReleaseReason.ABORTED)
            await assert_left_nothing(w)

    asyncio.run(main())


@pytest.mark.parametrize("end", ["pulled", "aborted", "expired"])
def test_kv_a_decode_core_hands_over_leaves_by_its_lease(tiny_llama_dir, end):
    """An elastic worker's decode core hands a stream over with its KV: between two steps the
    engine holds the decoding sequence (``hold_running``) and the prefill core adopts its blocks
    under a lease (``adopt``). That KV leaves as a prefilled prompt's does: read by the next
    decode worker, released, or expired; every block comes back."""
    async def main():
        async with worker(tiny_llama_dir, lease_seconds=0.3 if end == "expired" else 30.0) as (w, _):
            params = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
            await w.call(w.engine.add_request, "moved#0", PROMPT, params)
            seq = w.engine._requests["moved#0"].seq
            while seq.num_output_tokens < 3:  # a racy read, enough to wait on
                await asyncio.sleep(0.005)

            def hand_over():
                block_ids, tokens = w.engine.hold_running("moved#0")
                assert tokens == seq.num_tokens - 1  # every token but the newest
                return w.adopt("moved#0", block_ids, tokens), seq.num_output_tokens

            lease, made = await w.call(hand_over)
            assert len(lease.block_ids) == -(-(len(PROMPT) + made - 1) // 16)
            assert len(lease.checksums) == len(lease.block_ids)  # taken from the tokens it computed
            if end == "pulled":
                await w.claim(lease.token, list(lease.block_ids))
                read = await asyncio.to_thread(pull, w, lease, num_tokens=len(PROMPT) + made - 1)
                assert read is TransferState.DONE  # every block as the decode core computed it
            elif end == "aborted":
                assert await w.release(lease.token, ReleaseReason.ABORTED)
            await assert_left_nothing(w)
            assert seq.num_output_tokens == made  # it made nothing more after the hand-over
            return w.leases.released_by

    assert asyncio.run(main())[end] == 1
