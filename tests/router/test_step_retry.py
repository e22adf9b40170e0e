"""A request whose worker's step failed through no fault of its own (``Failure.STEP_FAILED``:
the engine split the step's batch and pinned the fault on no request) is served elsewhere, and
the worker stays in the routing table; a fault pinned on the request itself (INVALID_ARGUMENT,
field "step") ends it without a retry. The workers are in-process fakes of the gRPC stubs."""

import asyncio

import grpc
import pytest

from pdserve.engine.errors import InvalidRequestError
from pdserve.wire.failure import FAILURE_KEY, Failure
from tests.metrics.metrics_helpers import FakeDecode, FakePrefill, _DecodeCall, fake_pool, request_run, sample


def step_failed() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                grpc.aio.Metadata((FAILURE_KEY, Failure.STEP_FAILED.value)),
                                "engine step failed (RuntimeError: broken); aborted 1 request(s) of that step")


def own_fault() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(),
                                grpc.aio.Metadata(("pdserve-field", "step")),
                                "step: request failed in the engine: the engine step raised RuntimeError")


class CountingPrefill(FakePrefill):
    def __init__(self, errors=()):
        super().__init__(errors)
        self.calls = 0

    async def Prefill(self, request, timeout=None):
        self.calls += 1
        return await super().Prefill(request, timeout)


class StepFailingDecode(FakeDecode):
    """A decode worker's stub whose first stream fails STEP_FAILED after ``after`` tokens."""

    def __init__(self, after: int):
        super().__init__()
        self.after, self.calls = after, 0

    def Decode(self, request, timeout=None):
        self.calls += 1
        if self.calls > 1:
            return super().Decode(request, timeout)
        return _StepFailingCall(request, self.after)


class _StepFailingCall(_DecodeCall):
    def __init__(self, request, after: int):
        super().__init__(request, 0.01, None, 0.0)
        self.after = after

    async def _stream(self):
        sent = 0
        async for resp in super()._stream():
            if resp.token_ids and sent == self.after:
                raise step_failed()
            sent += len(resp.token_ids)
            yield resp


def tokens_of(run) -> list[int]:
    async def collect():
        return [t async for r in run.responses() for t in r.token_ids]

    return asyncio.run(collect())


def test_a_prefill_step_that_failed_through_no_fault_of_the_request_is_retried_on_another_worker():
    first, second = CountingPrefill(), CountingPrefill()
    second.errors = first.errors = [step_failed()]  # one list: whichever is asked first fails once
    pool = fake_pool([first, second], [FakeDecode()])
    retried = sample("pdserve:request_retries_total")
    assert tokens_of(request_run(pool, max_tokens=4)) == [1, 2, 3, 4]
    assert (first.calls, second.calls) == (1, 1)
    assert all(w.healthy for w in pool.workers.values())  # a failed step does not mark its worker down
    assert sample("pdserve:request_retries_total") == retried + 1


def test_a_decode_step_that_failed_through_no_fault_of_the_request_migrates_it():
    decode = StepFailingDecode(after=2)
    pool = fake_pool([FakePrefill()], [decode])
    migrated = sample("pdserve:request_migrations_total")
    run = request_run(pool, max_tokens=6)
    assert tokens_of(run) == [1, 2, 3, 1, 2, 3]  # the fakes number each attempt's tokens afresh
    assert decode.calls == 2 and run.migrations == 1
    assert all(w.healthy for w in pool.workers.values())
    assert sample("pdserve:request_migrations_total") == migrated + 1


def test_a_fault_pinned_on_the_request_is_not_retried():
    first, second = CountingPrefill([own_fault()]), CountingPrefill([own_fault()])
    pool = fake_pool([first, second], [FakeDecode()])
    with pytest.raises(InvalidRequestError) as err:
        tokens_of(request_run(pool))
    assert err.value.field == "step" and first.calls + second.calls == 1
