"""Streamed KV (PrefillStream + WatchKV): the decode worker reads each chunk's blocks while the
prefill worker computes the next ones. Real prefill and decode workers with their gRPC servers
in this process, a tiny random Llama, and the real transfer backends (NIXL, and tcp, whose
holder checks every read against the lease). The router is the real request run
(``pdserve.router.request_run.RequestRun``) over a pool of real stubs to those servers."""

import asyncio
import contextlib
import threading
import time

import grpc
import pytest
import torch

from pdserve.decode_worker.worker import DecodeWorker
from pdserve.engine.sampling.params import SamplingParams
from pdserve.kv_transfer.handoff import ReadNotice
from pdserve.prefill_worker.worker import PrefillWorker
from pdserve.protos import worker_pb2
from pdserve.router.frontend import ModelInfo, PreparedRequest
from pdserve.router.request_run import RequestRun
from pdserve.router.limits import RouterLimits
from pdserve.router.pool import WorkerPool
from tests.factories import assert_greedy_matches, decode_worker_config, make_engine, prefill_worker_config, random_prompts
from tests.helpers.worker_servers import serving, settle
from tests.metrics.metrics_helpers import LetterTokenizer

pytestmark = pytest.mark.slow

BLOCK, CHUNK = 16, 32
PROMPT = random_prompts(1, [100], seed=21)[0]  # 7 blocks (the last holds 4 tokens), 4 chunks
MAX_TOKENS = 8
# Each prefill step is held back this long: a tiny model's chunk takes a millisecond, less than
# one progress message's trip, so without it the decode worker would hear of several chunks
# at once (and fewer early reads would happen, by chance). 0.25 s is ~100x that trip.
STEP_S = 0.25


def expected_tokens(model_dir) -> list[int]:
    engine = make_engine(model_dir, max_num_batched_tokens=CHUNK)
    return engine.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))[0].token_ids


@contextlib.asynccontextmanager
async def workers(model_dir, backend: str, num_decode: int = 1):
    """A prefill worker that computes prompts in chunks of CHUNK tokens, and decode workers;
    prefix caching off, so that every prompt is computed, chunk by chunk, and freed blocks
    count as free."""
    prefill = PrefillWorker(prefill_worker_config(kv_transfer_backend=backend),
                            engine=make_engine(model_dir, num_blocks=64, max_num_batched_tokens=CHUNK,
                                               enable_prefix_cache=False))
    step = prefill.engine.step

    def slow_step():  # a chunk takes STEP_S, as a long prompt's chunk would: reads overlap compute
        time.sleep(STEP_S)
        return step()

    prefill.engine.step = slow_step
    decoders = [DecodeWorker(decode_worker_config(worker_id=f"decode-{i}", kv_transfer_backend=backend),
                             engine=make_engine(model_dir, num_blocks=64, enable_prefix_cache=False))
                for i in range(num_decode)]
    async with serving(prefill, decoders) as pool:
        yield prefill, decoders, pool


def request_run(pool: WorkerPool, rid: str, stream_kv: bool) -> RequestRun:
    model = ModelInfo("tiny", config=None, max_model_len=4096, block_size=BLOCK, tokenizer=LetterTokenizer())
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    limits = RouterLimits(stream_kv_min_tokens=1 if stream_kv else 0)
    return RequestRun(PreparedRequest(rid, list(PROMPT), params), model, pool, limits)


async def run_tokens(run: RequestRun) -> list[int]:
    return [t for resp in [r async for r in run.responses()] for t in resp.token_ids]


def spy_on_arrivals(decoder: DecodeWorker) -> dict[str, torch.Tensor]:
    """The prompt's KV as it lies in the decode worker's blocks when the transfer completes
    (tokens 0..len(PROMPT)-1, every layer, K and V), by request id."""
    landed, ready = {}, decoder.engine.kv_ready

    def kv_ready(request_id, first_token=None):
        table = decoder.engine.blocks.block_table(request_id)
        cache = decoder.engine.kv_cache
        slots = torch.tensor([table[t // BLOCK] * BLOCK + t % BLOCK for t in range(len(PROMPT))])
        landed[request_id] = cache.view(cache.shape[0] * BLOCK, -1)[slots].clone()
        ready(request_id, first_token)

    decoder.engine.kv_ready = kv_ready
    return landed


@pytest.mark.parametrize("backend", ["nixl", "tcp"])
def test_streamed_kv_lands_the_same_bytes_in_the_same_blocks_and_decodes_the_same_tokens(tiny_llama_dir, backend):
    model_dir = tiny_llama_dir[0]
    expected = expected_tokens(model_dir)

    async def main():
        async with workers(model_dir, backend) as (prefill, (decoder,), pool):
            landed = spy_on_arrivals(decoder)
            whole = request_run(pool, "whole", stream_kv=False)
            tokens = {"whole": await run_tokens(whole)}
            await settle(prefill, [decoder])
            reads_whole = decoder.agent.stats.snapshot().transfers
            expect_reads, progress = prefill.agent.expect_reads, []

            def spy(expected, urgent=True):  # the holder's progress: (reads may come, urgently)
                progress.append((expected, urgent))
                expect_reads(expected, urgent)

            prefill.agent.expect_reads = spy
            streamed = request_run(pool, "streamed", stream_kv=True)
            tokens["streamed"] = await run_tokens(streamed)
            await settle(prefill, [decoder])
            reads = decoder.agent.stats.snapshot().transfers - reads_whole
            return tokens, landed, reads_whole, reads, prefill.leases.released_by, (whole, streamed), progress

    tokens, landed, reads_whole, reads, released_by, runs, progress = asyncio.run(main())
    # While the prompt computes, its early reads get relaxed holder progress (nobody waits on
    # them; NIXL's progress thread would otherwise wake every millisecond on the prefill's
    # core); once it is done, urgent progress for the last read; none once the lease ended.
    changes = [p for i, p in enumerate(progress) if i == 0 or p != progress[i - 1]]
    assert changes[0] == (False, False) and (True, False) in changes and changes[-1] == (False, False)
    assert changes.index((True, False)) < changes.index((True, True))
    assert tokens == {"whole": expected, "streamed": expected}
    assert_greedy_matches(tiny_llama_dir[1], PROMPT, tokens["streamed"], MAX_TOKENS, what="streamed")  # transformers
    (whole_kv,), (streamed_kv,) = [[v for k, v in landed.items() if k.startswith(name)] for name in ("whole", "streamed")]
    assert torch.equal(whole_kv, streamed_kv)  # every prompt token's K and V, bit for bit
    # One read for the whole prompt. Streamed: one per chunk computed before the last (blocks
    # 0-1, 2-3, 4-5) and the last read (block 6), which ends the lease; progress messages that
    # arrive together (a loaded machine) merge two early reads into one, so at least 2.
    assert reads_whole == 1 and 2 <= reads <= 4
    assert released_by["pulled"] == 2 and released_by["transfer_failed"] == 0
    assert all(run.migrations == 0 for run in runs)


def test_a_streamed_transfer_that_fails_half_way_is_a_transfer_failure_and_the_request_re_prefills(tiny_llama_dir):
    """The holder refuses the second early read (tcp: the holder serves each read it
    authorizes, as a holder that went away would not): the decode worker fails the transfer and
    releases the lease, which stops the prompt still computing; the router re-prefills (one
    migration) and the client gets the same greedy tokens. Nothing stays held."""
    model_dir = tiny_llama_dir[0]
    expected = expected_tokens(model_dir)

    async def main():
        async with workers(model_dir, "tcp") as (prefill, decoders, pool):
            allow, partial_reads = prefill.agent.read_guard, []

            def guard(note: str, block_ids: list[int]) -> bool:
                if not ReadNotice.decode(note).ends_lease:
                    partial_reads.append(block_ids)
                    if len(partial_reads) == 2:
                        return False  # the second early read: refused half-way through the prompt
                return allow(note, block_ids)

            prefill.agent.read_guard = guard
            run = request_run(pool, "fails", stream_kv=True)
            tokens = await run_tokens(run)
            await settle(prefill, decoders)
            return tokens, run, prefill.leases.released_by, decoders[0].agent.stats.snapshot(), len(partial_reads)

    tokens, run, released_by, reader, partial_reads = asyncio.run(main())
    assert tokens == expected
    assert_greedy_matches(tiny_llama_dir[1], PROMPT, tokens, MAX_TOKENS, what="re-prefilled")
    assert run.migrations == 1
    assert released_by["transfer_failed"] == 1 and released_by["pulled"] == 1
    assert reader.failures == 1 and partial_reads >= 3  # the retry streamed again, and was served


def test_watch_kv_is_refused_without_a_claimed_streamed_lease(tiny_llama_dir):
    async def main():
        async with workers(tiny_llama_dir[0], "tcp") as (prefill, decoders, pool):
            stub = next(c.stub for c in pool.workers.values() if c.role == "prefill")
            call = stub.PrefillStream(worker_pb2.PrefillRequest(request_id="r", prompt_token_ids=PROMPT,
                                                                sampling=_sampling()), timeout=60)
            early = await call.read()
            with pytest.raises(grpc.aio.AioRpcError) as unclaimed:
                async for _ in stub.WatchKV(worker_pb2.WatchKVRequest(lease_token=early.kv.lease_token)):
                    pass
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                async for _ in stub.WatchKV(worker_pb2.WatchKVRequest(lease_token="guessed")):
                    pass
            call.cancel()  # the caller gives up: the prompt stops and its lease ends
            await settle(prefill, decoders)
            return early, unclaimed.value, unknown.value

    early, unclaimed, unknown = asyncio.run(main())
    assert early.kv_streaming and len(early.kv.block_ids) == 7 and early.kv.num_tokens == len(PROMPT)
    assert unclaimed.code() == unknown.code() == grpc.StatusCode.FAILED_PRECONDITION


def _sampling():
    from pdserve.protos import pdserve_pb2

    return pdserve_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def test_the_last_read_waits_for_every_earlier_read_so_the_lease_never_ends_under_one(tiny_llama_dir):
    """The race forced: the holder (tcp, which serves each read itself) holds the first early
    read back until the decode worker has asked for the last read, and a while longer. The last
    read's notice ends the lease and frees the prompt's blocks, so it must not start before the
    early read is done: the early read is still authorized when its bytes go out, the lease ends
    (PULLED) only after it, no transfer fails and no token changes."""
    model_dir = tiny_llama_dir[0]
    expected = expected_tokens(model_dir)

    async def main():
        async with workers(model_dir, "tcp") as (prefill, (decoder,), pool):
            allow, seen, ended_at = prefill.agent.read_guard, [], []

            def last_read_asked() -> bool:
                return any(p.deferred is not None or p.final_at is not None for p in list(decoder._pulls.values()))

            first = threading.Lock()  # the first early read is held back; the others go as they come

            def guard(note: str, block_ids: list[int]) -> bool:
                if not block_ids or ReadNotice.decode(note).ends_lease or not first.acquire(blocking=False):
                    return allow(note, block_ids)
                deadline = time.monotonic() + 20
                while not last_read_asked() and time.monotonic() < deadline:  # the prompt finishes meanwhile
                    time.sleep(0.01)
                time.sleep(0.5)  # time for a last read started now to land and end the lease
                seen.append((last_read_asked(), allow(note, block_ids), time.monotonic()))
                return seen[-1][1]

            lease_ended = prefill._lease_ended

            def spy(lease, reason):
                ended_at.append((reason.name, time.monotonic()))
                lease_ended(lease, reason)

            prefill.agent.read_guard, prefill._lease_ended = guard, spy
            run = request_run(pool, "raced", stream_kv=True)
            tokens = await run_tokens(run)
            await settle(prefill, [decoder])
            return tokens, run, seen, ended_at, decoder.agent.stats.snapshot(), decoder.engine.blocks.num_free_blocks

    tokens, run, seen, ended_at, reader, free_blocks = asyncio.run(main())
    assert len(seen) == 1
    asked, authorized, served_at = seen[0]
    assert asked and authorized  # the race was on, and the lease still stood for the early read
    assert [reason for reason, _ in ended_at] == ["PULLED"] and ended_at[0][1] > served_at
    assert tokens == expected and run.migrations == 0
    assert reader.failures == 0 and free_blocks == 64
