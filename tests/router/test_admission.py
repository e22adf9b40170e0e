"""A request that finds a pool full waits a bounded time for room: it goes on as soon as room
appears, and otherwise ends with RESOURCE_EXHAUSTED (HTTP 429) naming the pool's limit.
The workers are in-process fakes of the gRPC stubs: what is tested is the router's logic."""

import asyncio
import grpc
import pytest

from pdserve.protos import worker_pb2
from pdserve.router.http_errors import as_http_error
from pdserve.router.errors import RouteError
from tests.metrics.metrics_helpers import FakeDecode, FakePrefill, fake_pool, request_run, sample


def full_decode_pool(prefill: FakePrefill):
    pool = fake_pool([prefill], [FakeDecode()])
    pool.workers["decode-0:1"].stats = worker_pb2.WorkerStats(num_blocks_total=10, num_blocks_used=9)
    return pool


def run(pool, wait_s: float, max_tokens: int = 4, prompt_len: int = 20):
    """The request's stream, consumed; a request of ``prompt_len + max_tokens`` = 2 blocks."""
    r = request_run(pool, max_tokens=max_tokens, prompt_len=prompt_len, admission_wait_s=wait_s)

    async def consume():
        return [t for resp in [x async for x in r.responses()] for t in resp.token_ids]

    return consume


class CountingPrefill(FakePrefill):
    calls = 0

    async def Prefill(self, request, timeout=None):
        self.calls += 1
        return await super().Prefill(request, timeout)


def test_a_pool_that_stays_full_answers_resource_exhausted_before_any_prefill():
    prefill = CountingPrefill()
    pool = full_decode_pool(prefill)
    with pytest.raises(RouteError) as err:
        asyncio.run(run(pool, wait_s=0.3)())
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "KV cache is full" in str(err.value) and "2 blocks" in str(err.value)
    assert prefill.calls == 0  # no prompt work was spent on a request that could not be placed


def test_a_request_waits_for_room_and_then_completes():
    prefill = CountingPrefill()
    pool = full_decode_pool(prefill)

    async def main():
        request = asyncio.create_task(run(pool, wait_s=30.0)())
        await asyncio.sleep(0.5)
        assert not request.done() and prefill.calls == 0  # waiting, not failed
        pool.workers["decode-0:1"].stats = worker_pb2.WorkerStats(num_blocks_total=10, num_blocks_used=2)
        return await asyncio.wait_for(request, 10)

    assert asyncio.run(main()) == [1, 2, 3, 4]
    assert prefill.calls == 1


def test_a_saturated_pool_is_http_429_and_unavailable_is_503():
    busy = as_http_error(RouteError(grpc.StatusCode.RESOURCE_EXHAUSTED, "every decode worker's KV cache is full"))
    gone = as_http_error(RouteError(grpc.StatusCode.UNAVAILABLE, "no healthy decode worker"))
    assert (busy.status, busy.kind) == (429, "rate_limit_exceeded")
    assert (gone.status, gone.kind) == (503, "service_unavailable")


def test_the_wait_for_room_counts_as_queue_time():
    pool = full_decode_pool(FakePrefill(queue_seconds=0.0))
    before = sample("pdserve:request_queue_time_seconds_sum")

    async def main():
        request = asyncio.create_task(run(pool, wait_s=30.0)())
        await asyncio.sleep(0.5)
        pool.workers["decode-0:1"].stats = worker_pb2.WorkerStats(num_blocks_total=10, num_blocks_used=2)
        await asyncio.wait_for(request, 10)

    asyncio.run(main())
    assert sample("pdserve:request_queue_time_seconds_sum") - before >= 0.5
