"""Overload and deadlines in the router: past ``max_waiting_requests`` a request is refused at
once, a request that has streamed a token never ends RESOURCE_EXHAUSTED, and every wait and
RPC ends by the request's deadline. The workers are in-process fakes of the gRPC stubs (what
is tested is the router's logic; tests/fuzz runs the same against a live cluster)."""

import asyncio
import dataclasses
import time
from types import SimpleNamespace

import grpc
import pytest

from pdserve.protos import pdserve_pb2, worker_pb2
from pdserve.router.frontend import ModelInfo
from pdserve.router.errors import RouteError
from pdserve.router.limits import RouterLimits
from pdserve.router.service import GenerationService
from tests.helpers.fake_workers import SlowPrefill
from tests.metrics.metrics_helpers import FakeDecode, FakePrefill, LetterTokenizer, fake_pool


def service(prefill, decode=None, **limits) -> GenerationService:
    model = ModelInfo("fake", config=SimpleNamespace(vocab_size=1000), max_model_len=4096, block_size=16,
                      tokenizer=LetterTokenizer())
    return GenerationService(model, fake_pool([prefill], [decode or FakeDecode()]), RouterLimits(**limits))


def request(max_tokens: int = 3) -> pdserve_pb2.GenerateRequest:
    return pdserve_pb2.GenerateRequest(token_ids=pdserve_pb2.TokenIds(ids=[5, 6, 7]),
                                       sampling=pdserve_pb2.SamplingParams(max_tokens=max_tokens))


async def tokens(svc: GenerationService, req, timeout_s=None) -> list[int]:
    return [t async for r in svc.run(req, timeout_s) for t in r.token_ids]


def test_past_max_waiting_requests_refused_at_once_and_the_admitted_complete():
    async def main():
        prefill = SlowPrefill()
        svc = service(prefill, max_waiting_requests=2)
        admitted = [asyncio.create_task(tokens(svc, request())) for _ in range(2)]
        while svc.waiting < 2:
            await asyncio.sleep(0.01)
        started = time.monotonic()
        with pytest.raises(RouteError) as err:
            await tokens(svc, request())
        refused_after = time.monotonic() - started
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_waiting_requests=2" in str(err.value)
        prefill.release.set()
        assert [await t for t in admitted] == [[1, 2, 3], [1, 2, 3]]
        assert svc.waiting == 0 and not svc.running
        assert await tokens(svc, request()) == [1, 2, 3]  # room again
        return refused_after

    refused_after = asyncio.run(main())
    assert refused_after < 5  # not an admission wait (30 s); a loose bound, not a timing assert


def test_grpc_answers_resource_exhausted_with_retry_after():
    class Context:
        trailing = ()

        def set_trailing_metadata(self, md):
            self.trailing = md

        def time_remaining(self):
            return None

        def peer_identities(self):  # who the caller is (router.service.caller)
            return None

        def peer(self):
            return "ipv4:127.0.0.1:40000"

        async def abort(self, code, details):
            raise RouteError(code, details)

    async def main():
        prefill = SlowPrefill()
        svc = service(prefill, max_waiting_requests=1, retry_after_s=3)
        first = asyncio.create_task(tokens(svc, request()))
        while svc.waiting < 1:
            await asyncio.sleep(0.01)
        ctx = Context()
        with pytest.raises(RouteError):
            async for _ in svc.Generate(request(), ctx):
                pass
        prefill.release.set()
        await first
        return ctx.trailing

    assert asyncio.run(main()) == (("retry-after", "3"),)


def test_a_full_decode_pool_after_the_first_token_is_never_resource_exhausted():
    """Room at admission; the pool fills while prefill runs. The request already streamed its
    first token, so it waits for room until its deadline and ends DEADLINE_EXCEEDED."""

    class FillingPrefill(FakePrefill):
        pool = None

        async def Prefill(self, request, timeout=None):
            self.pool.workers["decode-0:1"].stats = worker_pb2.WorkerStats(num_blocks_total=10, num_blocks_used=10)
            return await super().Prefill(request, timeout)

    async def main():
        prefill = FillingPrefill()
        svc = service(prefill, admission_wait_s=0.2)
        prefill.pool = svc.pool
        svc.pool.workers["decode-0:1"].stats = worker_pb2.WorkerStats(num_blocks_total=10)
        got = []
        with pytest.raises(RouteError) as err:
            async for r in svc.run(request(), timeout_s=1.0):
                got += r.token_ids
        return got, err.value

    got, err = asyncio.run(main())
    assert got == [1]  # the first token was sent
    assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED and "after 1 tokens" in str(err)


def test_admission_waits_share_one_budget_from_arrival():
    """Tokenizing and waiting count against the same admission_wait_s: a request that spent
    it tokenizing is refused at its first full pool without a further wait."""

    class SlowTokenizer(LetterTokenizer):
        def encode(self, text):
            time.sleep(0.4)
            return [5, 6, 7]

    async def main():
        svc = service(FakePrefill(), admission_wait_s=0.3)
        svc.model = dataclasses.replace(svc.model, tokenizer=SlowTokenizer())
        svc.pool.workers["decode-0:1"].stats = worker_pb2.WorkerStats(num_blocks_total=10, num_blocks_used=10)
        req = pdserve_pb2.GenerateRequest(text="abc", sampling=pdserve_pb2.SamplingParams(max_tokens=3))
        with pytest.raises(RouteError) as err:
            await tokens(svc, req)
        return err.value, svc.running

    err, running = asyncio.run(main())
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and not running


def test_every_rpc_gets_the_requests_remaining_time():
    async def main():
        prefill = SlowPrefill()
        prefill.release.set()
        svc = service(prefill)
        assert await tokens(svc, request(), timeout_s=7.0) == [1, 2, 3]
        return prefill.timeouts

    (timeout,) = asyncio.run(main())
    assert 0 < timeout <= 7.0


def test_a_client_deadline_that_passes_in_prefill_is_deadline_exceeded():
    class DeadlinePrefill(FakePrefill):
        async def Prefill(self, request, timeout=None):
            await asyncio.sleep(timeout)
            raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata())

    async def main():
        svc = service(DeadlinePrefill())
        with pytest.raises(RouteError) as err:
            await tokens(svc, request(), timeout_s=0.3)
        return err.value, svc.pool.workers["prefill-0:1"].healthy

    err, healthy = asyncio.run(main())
    assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert healthy  # the request's own deadline is not the worker's fault


def test_a_silent_decode_stream_migrates_after_the_idle_timeout():
    class SilentOnce(FakeDecode):
        silent = True

        def Decode(self, request, timeout=None):
            if self.silent:
                self.silent = False
                return _Silent()
            return super().Decode(request, timeout)

    class _Silent:
        def __aiter__(self):
            return self

        async def __anext__(self):
            await asyncio.sleep(3600)

        def cancel(self):
            pass

    async def main():
        svc = service(FakePrefill(), SilentOnce(), decode_idle_timeout_s=0.2)
        return await tokens(svc, request(max_tokens=3))

    assert asyncio.run(main()) == [1, 1, 2]  # first token, then re-prefilled: the fake restarts at 1


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
def test_a_bad_client_timeout_is_invalid(value):
    from pdserve.engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as err:
        service(FakePrefill()).timeout_s(value)
    assert err.value.field == "timeout"


def test_draining_refuses_new_requests_and_waits_for_running_ones():
    async def main():
        prefill = SlowPrefill()
        svc = service(prefill)
        running = asyncio.create_task(tokens(svc, request()))
        while svc.waiting < 1:
            await asyncio.sleep(0.01)
        drain = asyncio.create_task(svc.drain(grace_s=10))
        await asyncio.sleep(0.05)
        with pytest.raises(RouteError) as err:
            await tokens(svc, request())
        assert err.value.code == grpc.StatusCode.UNAVAILABLE and not drain.done()
        prefill.release.set()
        return await running, await drain

    assert asyncio.run(main()) == ([1, 2, 3], 0)
