"""A worker's intake is bounded: past ``max_requests`` held at once, a new request is refused
at once with RESOURCE_EXHAUSTED naming the limit, and those admitted still complete. Real
prefill worker (tiny model, tcp KV agent) behind its real gRPC server; its engine thread is
held busy by a call so that the admitted prompts stay queued. A request over the server's
``max_receive_bytes`` is refused by the transport with RESOURCE_EXHAUSTED, never INTERNAL."""

import asyncio
import threading

import grpc
import pytest

from pdserve.prefill_worker.server import start
from pdserve.prefill_worker.worker import PrefillWorker
from pdserve.protos import pdserve_pb2, worker_pb2, worker_pb2_grpc
from tests.factories import make_engine, prefill_worker_config, random_prompts
from pdserve.wire.grpc_util import aio_channel


def prefill_request(rid: str, prompt) -> worker_pb2.PrefillRequest:
    return worker_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt,
                                     sampling=pdserve_pb2.SamplingParams(max_tokens=4))


def test_past_max_requests_a_worker_refuses_at_once_and_serves_the_admitted(tiny_llama_dir):
    config = prefill_worker_config(kv_transfer_backend="tcp", max_requests=2)
    worker = PrefillWorker(config, engine=make_engine(tiny_llama_dir[0]))
    prompts = random_prompts(3, [20, 20, 20], seed=9)
    hold = threading.Event()

    async def run():
        server = await start(config, worker)
        try:
            async with aio_channel(server.address) as channel:
                stub = worker_pb2_grpc.PrefillWorkerStub(channel)
                busy = asyncio.wrap_future(worker.thread.call(hold.wait, 60))  # the engine thread is held
                admitted = [asyncio.ensure_future(stub.Prefill(prefill_request(f"a{i}", prompts[i]), timeout=60))
                            for i in range(2)]
                while worker.requests() < 2:
                    await asyncio.sleep(0.01)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Prefill(prefill_request("b", prompts[2]), timeout=5)
                hold.set()
                await busy
                answers = await asyncio.gather(*admitted)
                for a in answers:
                    await stub.Release(worker_pb2.ReleaseRequest(lease_token=a.kv.lease_token), timeout=5)
                again = await stub.Prefill(prefill_request("c", prompts[2]), timeout=60)  # room again
                await stub.Release(worker_pb2.ReleaseRequest(lease_token=again.kv.lease_token), timeout=5)
                return refused.value, answers
        finally:
            hold.set()
            await server.stop()

    refused, answers = asyncio.run(run())
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_requests (2)" in refused.details()
    assert all(a.HasField("kv") for a in answers)


def test_a_request_over_max_receive_bytes_is_resource_exhausted_and_the_worker_serves_on(tiny_llama_dir):
    config = prefill_worker_config(kv_transfer_backend="tcp", max_receive_bytes=16 << 10)
    worker = PrefillWorker(config, engine=make_engine(tiny_llama_dir[0]))
    small = random_prompts(1, [20], seed=10)[0]

    async def run():
        server = await start(config, worker)
        try:
            async with aio_channel(server.address) as channel:
                stub = worker_pb2_grpc.PrefillWorkerStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as refused:  # ~30 KB of token ids
                    await stub.Prefill(prefill_request("big", [100_000] * 10_000), timeout=30)
                ok = await stub.Prefill(prefill_request("small", small), timeout=60)
                await stub.Release(worker_pb2.ReleaseRequest(lease_token=ok.kv.lease_token), timeout=5)
                return refused.value, ok
        finally:
            await server.stop()

    refused, ok = asyncio.run(run())
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ok.HasField("kv")
