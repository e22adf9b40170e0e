"""A pool left with no routable worker (its only decode worker crashed) is waited on, within
the request's deadline, for the replacement the supervisor starts: the stream migrates to it
instead of failing with "no healthy decode worker". The workers are in-process fakes of the
gRPC stubs; tests/serving/test_faults.py kills real workers."""

import asyncio

import grpc
import pytest

from pdserve.protos import worker_pb2
from pdserve.router.errors import RouteError
from pdserve.router.policy import WorkerSnapshot, pick_decode, pick_prefill
from pdserve.router.pool import WorkerClient
from tests.metrics.metrics_helpers import FakeDecode, FakePrefill, fake_pool, request_run


def snapshot(worker_id: str, role: str, healthy: bool = True) -> WorkerSnapshot:
    return WorkerSnapshot(worker_id, role, healthy, blocks_total=100)


def test_an_empty_pool_is_told_apart_from_every_worker_tried():
    assert pick_decode([snapshot("d0", "decode", healthy=False)], 1).pool_empty
    assert pick_prefill([]).pool_empty
    tried = pick_decode([snapshot("d0", "decode")], 1, exclude=frozenset({"d0"}))
    assert tried.worker_id is None and not tried.pool_empty and not tried.saturated


async def _collect(run) -> list:
    return [r async for r in run.responses()]


def test_a_crash_of_the_only_decode_worker_waits_for_its_replacement():
    async def main():
        pool = fake_pool([FakePrefill()], [FakeDecode(fail_after=1)])  # dies after one decoded token
        run = request_run(pool, max_tokens=5)

        async def supervisor():
            while pool.workers["decode-0:1"].healthy:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)  # the replacement loads and joins the membership
            pool.workers["decode-1:1"] = WorkerClient("decode", "decode-1:1", channel=None, stub=FakeDecode(),
                                                      healthy=True, stats=worker_pb2.WorkerStats(num_blocks_total=1000))

        replacing = asyncio.create_task(supervisor())
        responses = await _collect(run)
        await replacing
        return responses, run

    responses, run = asyncio.run(main())
    assert sum(len(r.token_ids) for r in responses) == 5
    assert run.migrations == 1 and run.output.finish_reason is not None


def test_no_replacement_within_the_deadline_ends_with_a_clear_error():
    async def main():
        run = request_run(fake_pool([FakePrefill()], [FakeDecode(fail_after=1)]), max_tokens=5,
                          request_timeout_s=1.0)
        return await _collect(run)

    with pytest.raises(RouteError) as err:
        asyncio.run(main())
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
