"""Fake workers beyond tests/metrics/metrics_helpers.py's (tests/router): a prefill worker
that holds every prefill until released, workers frozen mid-flight (they accept calls and
never answer, as a SIGSTOPped process does), and a decode worker that prefills itself."""

import asyncio

import grpc

from pdserve.protos import pdserve_pb2, worker_pb2
from tests.metrics.metrics_helpers import FakeDecode, FakePrefill, rpc_error


class SlowPrefill(FakePrefill):
    """Holds every prefill until ``release`` is set; records the timeout it was given."""

    def __init__(self):
        super().__init__()
        self.release = asyncio.Event()
        self.timeouts: list[float] = []

    async def Prefill(self, request, timeout=None):
        self.timeouts.append(timeout)
        await self.release.wait()
        return await super().Prefill(request, timeout)


class _Unanswered:
    """A call to a worker that holds its socket and never answers (SIGSTOPped): as gRPC's
    call object, awaitable and cancellable; it fails DEADLINE_EXCEEDED at its ``timeout``."""

    def __init__(self, timeout: float | None):
        self.task = asyncio.ensure_future(self._never(timeout))

    @staticmethod
    async def _never(timeout):
        await asyncio.sleep(timeout if timeout is not None else 3600)
        raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")

    def __await__(self):
        return self.task.__await__()

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.task

    def cancel(self) -> None:
        self.task.cancel()


class FrozenPrefill(FakePrefill):
    """A prefill worker frozen mid-flight: every Prefill is accepted and never answered;
    records each call's timeout."""

    def __init__(self):
        super().__init__()
        self.timeouts: list[float | None] = []

    def Prefill(self, request, timeout=None):
        self.timeouts.append(timeout)
        return _Unanswered(timeout)


class FrozenDecode(FakeDecode):
    """A decode worker that takes every stream and never sends a message."""

    def Decode(self, request, timeout=None):
        return _Unanswered(timeout)


class LocalDecode(FakeDecode):
    """A decode worker that also prefills a prompt itself (``local_prefill``): its stream's
    first message is the prefill answer, then one token per message. Records each request."""

    def __init__(self):
        super().__init__()
        self.requests: list = []

    def Decode(self, request, timeout=None):
        self.requests.append(request)
        if not request.local_prefill:
            return super().Decode(request, timeout)
        return _LocalCall(request)


class _LocalCall:
    def __init__(self, request):
        self.request = request

    def __aiter__(self):
        return self._stream(self.request)

    def cancel(self) -> None:
        pass

    @staticmethod
    async def _stream(request):
        yield worker_pb2.DecodeResponse(prefilled=worker_pb2.PrefillResponse(
            request_id=request.request_id, first_token_id=1, prefill_seconds=0.01))
        remaining = request.sampling.max_tokens - 1
        for i in range(remaining):
            yield worker_pb2.DecodeResponse(
                token_ids=[2 + i], finish_reason=pdserve_pb2.FINISH_REASON_LENGTH if i == remaining - 1 else 0)
