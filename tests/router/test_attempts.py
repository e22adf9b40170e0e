"""A request's attempts in the router: the one reading of a worker's error (``triage``), and
the local-prefill attempt, whose decode stream starts with a typed prefill answer. The
workers are in-process fakes of the gRPC stubs."""

import asyncio
import time

import grpc
import pytest

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.sampling import SamplingParams
from pdserve.protos import pdserve_pb2, worker_pb2
from pdserve.router.errors import RouteError
from pdserve.router.frontend import PreparedRequest
from pdserve.router.limits import RouterLimits
from pdserve.router.local_prefill import LocalPrefillConfig
from pdserve.router.request_budget import RequestBudget
from pdserve.router.request_run import RequestRun
from pdserve.router.worker_calls import Fault, triage
from pdserve.wire.failure import FAILURE_KEY, Failure
from tests.metrics.metrics_helpers import FakeDecode, fake_pool, request_run


def rpc_error(code: grpc.StatusCode, details: str = "", **trailers: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailers.items()), details)


def budget(timeout_s: float = 60.0) -> RequestBudget:
    return RequestBudget(time.monotonic(), timeout_s, admission_wait_s=1.0, sent=lambda: 0)


@pytest.mark.parametrize("code,fault", [
    (grpc.StatusCode.UNAVAILABLE, Fault.WORKER), (grpc.StatusCode.INTERNAL, Fault.WORKER),
    (grpc.StatusCode.UNKNOWN, Fault.WORKER), (grpc.StatusCode.CANCELLED, Fault.WORKER),
    (grpc.StatusCode.DEADLINE_EXCEEDED, Fault.WORKER), (grpc.StatusCode.RESOURCE_EXHAUSTED, Fault.BUSY),
    (grpc.StatusCode.PERMISSION_DENIED, Fault.REFUSED), (grpc.StatusCode.FAILED_PRECONDITION, Fault.REFUSED),
])
def test_a_worker_error_reads_as_one_fault(code, fault):
    assert triage(rpc_error(code), budget()) is fault


def test_a_failed_transfer_is_the_transfers_fault_whatever_its_code():
    for code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED, grpc.StatusCode.FAILED_PRECONDITION):
        assert triage(rpc_error(code, **{FAILURE_KEY: Failure.KV_TRANSFER.value}), budget()) is Fault.TRANSFER


def test_the_requests_own_faults_end_it_on_any_worker():
    with pytest.raises(InvalidRequestError) as err:
        triage(rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "top_k: bad", **{"pdserve-field": "top_k"}), budget())
    assert err.value.field == "top_k"
    with pytest.raises(RouteError) as err:
        triage(rpc_error(grpc.StatusCode.ABORTED, "step raised", **{FAILURE_KEY: Failure.STEP_FAILED.value}),
               budget())
    assert err.value.code == grpc.StatusCode.ABORTED
    with pytest.raises(RouteError) as err:  # a passed deadline is not the worker's fault
        triage(rpc_error(grpc.StatusCode.UNAVAILABLE), budget(timeout_s=-1.0))
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


class LocalDecode(FakeDecode):
    """A decode worker's stub that prefills locally: the prefill answer first, then tokens.
    ``output_first``: a broken worker that sends a token before its answer."""

    def __init__(self, output_first: bool = False):
        super().__init__()
        self.output_first = output_first
        self.requests: list[worker_pb2.DecodeRequest] = []

    def Decode(self, request, timeout=None):
        self.requests.append(request)
        return _LocalCall(request, self.output_first)


class _LocalCall:
    def __init__(self, request, output_first: bool):
        self.request, self.output_first = request, output_first

    def __aiter__(self):
        return self._stream()

    async def _stream(self):
        if self.output_first:
            yield worker_pb2.DecodeResponse(token_ids=[9])
        yield worker_pb2.DecodeResponse(prefilled=worker_pb2.PrefillResponse(
            first_token_id=1, first_logprob=-0.5, num_cached_tokens=2, prefill_seconds=0.1,
            prompt_logprobs=[-1.0] * (len(self.request.prompt_token_ids) - 1),
            prompt_top_logprobs=[pdserve_pb2.TopLogprobs()] * (len(self.request.prompt_token_ids) - 1)))
        remaining = self.request.sampling.max_tokens - 1
        for i in range(remaining):
            yield worker_pb2.DecodeResponse(token_ids=[2 + i], logprobs=[-0.25],
                                            finish_reason=pdserve_pb2.FINISH_REASON_LENGTH if i == remaining - 1 else 0)

    def cancel(self) -> None:
        pass


def local_run(decode: LocalDecode, **limits) -> RequestRun:
    plain = request_run(fake_pool([], [decode]), max_tokens=4)
    params = SamplingParams(max_tokens=4, logprobs=True, prompt_logprobs=0, stop=("zz",))
    return RequestRun(PreparedRequest("req-1", plain.req.prompt_token_ids, params), plain.model, plain.pool,
                      RouterLimits(local_prefill=LocalPrefillConfig(colocated=True), **limits))


def test_a_local_prefill_answer_is_sent_as_a_prefill_workers_is():
    decode = LocalDecode()
    run = local_run(decode)

    async def collect():
        return [r async for r in run.responses()]

    responses = asyncio.run(collect())
    first = responses[0]
    assert list(first.token_ids) == [1] and list(first.logprobs) == [-0.5]
    assert list(first.prompt_token_ids) == run.req.prompt_token_ids
    assert len(first.prompt_logprobs) == len(run.req.prompt_token_ids) - 1
    assert [t for r in responses for t in r.token_ids] == [1, 2, 3, 4]
    assert responses[-1].usage.cached_prompt_tokens == 2 and responses[-1].usage.completion_tokens == 4
    (request,) = decode.requests
    assert request.local_prefill and not request.HasField("kv") and not request.sampling.stop


def test_output_before_the_prefill_answer_loses_the_attempt():
    run = local_run(LocalDecode(output_first=True), max_migrations=0)

    async def collect():
        return [r async for r in run.responses()]

    with pytest.raises(RouteError) as err:
        asyncio.run(collect())
    assert err.value.code == grpc.StatusCode.UNAVAILABLE and "before its prefill answer" in str(err.value)
