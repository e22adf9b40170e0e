"""A request's attempts in the router: the one reading of a worker's error (``triage``), the
local-prefill attempt, whose decode stream starts with a typed prefill answer, and the attempt
that goes on from KV a decode worker handed over. The workers are in-process fakes of the gRPC
stubs."""

import asyncio
import time

import grpc
import pytest

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.sampling.params import SamplingParams
from pdserve.protos import pdserve_pb2, worker_pb2
from pdserve.router.errors import RouteError
from pdserve.router.frontend import PreparedRequest
from pdserve.router.limits import RouterLimits
from pdserve.router.local_prefill import LocalPrefillConfig
from pdserve.router.request_budget import RequestBudget
from pdserve.router.request_run import RequestRun
from pdserve.router.worker_calls import Fault, triage
from pdserve.wire.failure import FAILURE_KEY, Failure
from tests.metrics.metrics_helpers import FakeDecode, FakePrefill, fake_pool, request_run, sample


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


def test_a_failed_step_pinned_on_no_request_is_not_the_requests_fault():
    for code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED):  # ABORTED: workers before the split
        assert triage(rpc_error(code, "step raised", **{FAILURE_KEY: Failure.STEP_FAILED.value}), budget()) is Fault.STEP


def test_a_failed_transfer_is_the_transfers_fault_whatever_its_code():
    for code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED, grpc.StatusCode.FAILED_PRECONDITION):
        assert triage(rpc_error(code, **{FAILURE_KEY: Failure.KV_TRANSFER.value}), budget()) is Fault.TRANSFER


def test_the_requests_own_faults_end_it_on_any_worker():
    with pytest.raises(InvalidRequestError) as err:
        triage(rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "top_k: bad", **{"pdserve-field": "top_k"}), budget())
    assert err.value.field == "top_k"
    with pytest.raises(InvalidRequestError) as err:  # a step fault its worker pinned on it alone
        triage(rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "step: raised alone", **{"pdserve-field": "step"}),
               budget())
    assert err.value.field == "step"
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


class HandingOverDecode(FakeDecode):
    """A decode worker's stub that, ``after`` tokens into its first stream (None: never), hands the stream
    over with its KV (an elastic worker changing role): ``handed_over`` names a lease on the
    prompt and every token sent but the last, held at ``holder`` (out of the decode pool, as an
    elastic worker that changed role is). ``off_by``: a handle that holds that many tokens
    more (a worker out of step with what it sent). Later streams continue the numbering from
    their first token, as the same model would, and finish at ``max_tokens``."""

    def __init__(self, after: int | None = None, off_by: int = 0, holder: str = "elastic-0:1", on_hand_over=None):
        super().__init__()
        self.after, self.off_by, self.holder = after, off_by, holder
        self.on_hand_over = on_hand_over or (lambda: None)  # called as it hands the stream over
        self.requests: list[worker_pb2.DecodeRequest] = []

    def Decode(self, request, timeout=None):
        self.requests.append(request)
        return _HandingOverCall(request, self.after if len(self.requests) == 1 else None, self.off_by, self.holder,
                                self.on_hand_over)


class _HandingOverCall:
    def __init__(self, request, after: int | None, off_by: int, holder: str, on_hand_over):
        self.request, self.after, self.off_by, self.holder = request, after, off_by, holder
        self.on_hand_over = on_hand_over

    def __aiter__(self):
        return self._stream()

    async def _stream(self):
        yield worker_pb2.DecodeResponse(kv_bytes=1024, kv_transfer_seconds=0.01)
        first, remaining = self.request.first_token_id, self.request.sampling.max_tokens - 1
        for i in range(remaining):
            if i == self.after:
                # KV of the prompt, the first token and the i tokens sent here, but the last
                kv = worker_pb2.KVHandle(prefill_address=self.holder, block_ids=[7, 8], lease_token="moved",
                                         num_tokens=len(self.request.prompt_token_ids) + i + self.off_by)
                self.on_hand_over()
                yield worker_pb2.DecodeResponse(handed_over=kv)
                return
            yield worker_pb2.DecodeResponse(token_ids=[first + 1 + i],
                                            finish_reason=pdserve_pb2.FINISH_REASON_LENGTH if i == remaining - 1 else 0)

    def cancel(self) -> None:
        pass


def moving_run(decode: HandingOverDecode, max_tokens: int = 8, **limits) -> RequestRun:
    return request_run(fake_pool([FakePrefill()], [decode]), max_tokens=max_tokens, **limits)


def test_a_stream_handed_over_with_its_kv_goes_on_from_it_without_a_prefill():
    """The next decode call reads the moved KV: its prompt is the client's prompt and every
    token sent but the last, which is its first token; max_tokens counts that token again as
    a prefill answer's would be counted. The client sees one unbroken stream, and the run counts
    a move, not a re-prefill."""
    decode = HandingOverDecode(after=3)
    run = moving_run(decode, max_migrations=0)  # a move is no fault: the limit on re-prefills leaves it be
    moves, migrations = sample("pdserve:request_kv_moves_total"), sample("pdserve:request_migrations_total")

    async def collect():
        return [t async for r in run.responses() for t in r.token_ids]

    assert asyncio.run(collect()) == [1, 2, 3, 4, 5, 6, 7, 8]  # the prefill's 1, three, then the rest
    first, moved = decode.requests
    sent = [1, 2, 3, 4]
    assert list(moved.prompt_token_ids) == run.req.prompt_token_ids + sent[:-1]
    assert moved.first_token_id == sent[-1] and moved.kv.lease_token == "moved"
    assert moved.sampling.max_tokens == 8 - (len(sent) - 1) and not moved.local_prefill
    assert moved.request_id != first.request_id  # a new attempt
    assert sample("pdserve:request_kv_moves_total") == moves + 1
    assert sample("pdserve:request_migrations_total") == migrations


def test_moved_kv_that_does_not_hold_what_was_sent_is_re_prefilled():
    """A handle one token off is not used (its lease is released): the run re-prefills prompt +
    tokens sent, as after a lost worker, and the client's tokens are still whole."""
    decode = HandingOverDecode(after=2, off_by=1, holder="gone:1")  # an address the pool does not know
    run = moving_run(decode)
    migrations = sample("pdserve:request_migrations_total")

    async def collect():
        return [t async for r in run.responses() for t in r.token_ids]

    tokens = asyncio.run(collect())
    first, again = decode.requests
    assert list(again.prompt_token_ids) == run.req.prompt_token_ids + [1, 2, 3]  # re-prefilled: all it was sent
    assert again.kv.lease_token == "lease" and tokens[:3] == [1, 2, 3] and len(tokens) == 8  # the prefill's lease
    assert sample("pdserve:request_migrations_total") == migrations + 1



class HeldBy(FakePrefill):
    """A prefill answer whose KV is held at ``holder``."""

    def __init__(self, holder: str):
        super().__init__()
        self.holder = holder

    async def Prefill(self, request, timeout=None):
        answer = await super().Prefill(request, timeout)
        answer.kv.prefill_address = self.holder
        return answer


def test_the_kv_source_is_never_its_own_decode_worker():
    """A decode worker cannot read KV from its own agent (an elastic worker that took the
    decode role while still holding KV it prefilled): the KV's holder, though the emptiest
    decode worker, is passed over for the other one."""
    holder, other = HandingOverDecode(), HandingOverDecode()
    pool = fake_pool([HeldBy("decode-0:1")], [holder, other])
    pool.workers["decode-1:1"].stats.num_blocks_used = 500  # the holder is the emptier

    async def collect():
        return [t async for r in request_run(pool, max_tokens=4).responses() for t in r.token_ids]

    assert asyncio.run(collect()) == [1, 2, 3, 4]
    assert not holder.requests and len(other.requests) == 1


class ReleaseRecorder(FakePrefill):
    """A prefill worker's stub (the moved KV's holder) that records the leases released."""

    def __init__(self):
        super().__init__()
        self.released: list[str] = []

    def Release(self, request, timeout=None):
        self.released.append(request.lease_token)
        return super().Release(request, timeout)


def test_moved_kv_with_no_decode_worker_to_take_it_is_released():
    """The stream is handed over, and no decode worker has room for it until the request's
    deadline (after its first token a request waits for room up to its deadline): it fails, and
    the lease on the moved KV is released then, not left to expire."""
    holder = ReleaseRecorder()

    def full() -> None:  # no room left for the moved stream
        pool.workers["decode-0:1"].stats.num_blocks_used = pool.workers["decode-0:1"].stats.num_blocks_total

    pool = fake_pool([holder], [HandingOverDecode(after=2, holder="prefill-0:1", on_hand_over=full)])
    run = request_run(pool, max_tokens=8, request_timeout_s=1.0)

    async def collect():
        out = []
        with pytest.raises(RouteError) as err:
            async for r in run.responses():
                out += r.token_ids
        await asyncio.sleep(0)  # the release is scheduled, not awaited
        return out, err.value

    tokens, err = asyncio.run(collect())
    assert tokens == [1, 2, 3] and err.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert holder.released == ["moved"]
