"""Shared helpers for the metrics tests: reading the registry, a fake clock, fake workers."""

from __future__ import annotations

import asyncio

import grpc

from pdserve.engine.sampling.params import SamplingParams
from pdserve.protos import pdserve_pb2, worker_pb2
from pdserve.router.frontend import ModelInfo, PreparedRequest
from pdserve.router.request_run import RequestRun
from pdserve.router.limits import RouterLimits
from pdserve.router.pool import WorkerClient, WorkerPool
from pdserve.wire import metrics


def sample(name: str, **labels: str) -> float:
    """The sum of the samples named ``name`` whose labels include ``labels`` (so a family's
    ``model_name`` need not be named), in pdserve's registry; 0 when none exists yet."""
    return sum(s.value for family in metrics.REGISTRY.collect() for s in family.samples
               if s.name == name and labels.items() <= s.labels.items())


def samples(*names: str, **labels: str) -> dict[str, float]:
    return {n: sample(n, **labels) for n in names}


def deltas(before: dict[str, float], **labels: str) -> dict[str, float]:
    return {n: sample(n, **labels) - v for n, v in before.items()}


class FakeClock:
    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def rpc_error(code: grpc.StatusCode, details: str = "") -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class LetterTokenizer:
    """Each token id is one letter: enough for the router's incremental detokenizer."""

    def decode(self, ids) -> str:
        return "".join(chr(97 + i % 26) for i in ids)


class FakePrefill:
    """A prefill worker's stub: raises the queued errors first, then answers."""

    def __init__(self, errors=(), queue_seconds: float = 0.1, prefill_seconds: float = 0.3):
        self.errors = list(errors)
        self.queue_seconds, self.prefill_seconds = queue_seconds, prefill_seconds

    async def Prefill(self, request, timeout=None):
        if self.errors:
            raise self.errors.pop(0)
        return worker_pb2.PrefillResponse(
            request_id=request.request_id, first_token_id=1, kv=worker_pb2.KVHandle(lease_token="lease"),
            prefill_seconds=self.prefill_seconds, queue_seconds=self.queue_seconds)

    def Release(self, request, timeout=None) -> asyncio.Future:
        # Already done: the router only schedules it, and a test's loop may close first.
        done = asyncio.get_running_loop().create_future()
        done.set_result(worker_pb2.ReleaseResponse(released=True))
        return done


class FakeDecode:
    """A decode worker's stub: streams the KV notice, then one token per response.

    ``fail_after`` tokens into its first stream it fails as a dead worker would; each token
    takes ``token_s`` of real time.
    """

    def __init__(self, kv_seconds: float = 0.02, fail_after: int | None = None, token_s: float = 0.0):
        self.kv_seconds, self.fail_after, self.token_s = kv_seconds, fail_after, token_s

    def Decode(self, request, timeout=None):
        fail_after, self.fail_after = self.fail_after, None
        return _DecodeCall(request, self.kv_seconds, fail_after, self.token_s)

    async def HoldPrefix(self, request, timeout=None):
        """Holds nothing (as a worker whose cache lost the prefix): the prefill worker computes it all."""
        self.holds = getattr(self, "holds", 0) + 1
        return worker_pb2.HoldPrefixResponse()

    def Release(self, request, timeout=None) -> asyncio.Future:
        done = asyncio.get_running_loop().create_future()
        done.set_result(worker_pb2.ReleaseResponse(released=True))
        return done


class _DecodeCall:
    def __init__(self, request, kv_seconds: float, fail_after: int | None, token_s: float):
        self.request, self.kv_seconds, self.fail_after, self.token_s = request, kv_seconds, fail_after, token_s

    def __aiter__(self):
        return self._stream()

    async def _stream(self):
        yield worker_pb2.DecodeResponse(kv_bytes=1024, kv_transfer_seconds=self.kv_seconds)
        remaining = self.request.sampling.max_tokens - 1  # the first token came from prefill
        for i in range(remaining):
            if i == self.fail_after:
                raise rpc_error(grpc.StatusCode.UNAVAILABLE, "worker gone")
            await asyncio.sleep(self.token_s)
            last = i == remaining - 1
            yield worker_pb2.DecodeResponse(
                token_ids=[2 + i], finish_reason=pdserve_pb2.FINISH_REASON_LENGTH if last else 0)

    def cancel(self) -> None:
        pass


def fake_pool(prefills: list[FakePrefill], decodes: list[FakeDecode]) -> WorkerPool:
    pool = WorkerPool()
    for role, stubs in (("prefill", prefills), ("decode", decodes)):
        for i, stub in enumerate(stubs):
            address = f"{role}-{i}:1"
            pool.workers[address] = WorkerClient(role, address, channel=None, stub=stub, healthy=True,
                                                 stats=worker_pb2.WorkerStats(num_blocks_total=1000))
    return pool


def request_run(pool: WorkerPool, max_tokens: int = 4, prompt_len: int = 7, **limits) -> RequestRun:
    model = ModelInfo("fake", config=None, max_model_len=4096, block_size=16, tokenizer=LetterTokenizer())
    req = PreparedRequest("req-1", list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=max_tokens))
    return RequestRun(req, model, pool, RouterLimits(**limits))
