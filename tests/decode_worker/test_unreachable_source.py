"""A decode worker told to pull from a prefill worker that does not answer: the client of the
RPC (the router) gets UNAVAILABLE, the failed transfer is counted, and no block stays taken.
Real decode worker (tiny model, NIXL agent) behind its real gRPC server."""

import asyncio
import socket

import grpc

from pdserve.decode_worker.server import start
from pdserve.decode_worker.worker import DecodeWorker, DecodeWorkerConfig
from pdserve.protos import pdserve_pb2, worker_pb2, worker_pb2_grpc
from tests.factories import make_engine
from pdserve.wire.grpc_util import aio_channel


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nobody listens once the socket closes


def test_an_unreachable_prefill_worker_is_a_counted_transfer_failure(tiny_llama_dir):
    config = DecodeWorkerConfig(worker_id="decode-unreachable")
    worker = DecodeWorker(config, engine=make_engine(tiny_llama_dir[0]))

    async def run():
        server = await start(config, worker)
        try:
            async with aio_channel(server.address) as channel:
                stub = worker_pb2_grpc.DecodeWorkerStub(channel)
                request = worker_pb2.DecodeRequest(
                    request_id="r1", prompt_token_ids=list(range(3, 23)), first_token_id=5,
                    sampling=pdserve_pb2.SamplingParams(max_tokens=4),
                    kv=worker_pb2.KVHandle(prefill_address=f"127.0.0.1:{closed_port()}",
                                           block_ids=[0, 1], num_tokens=20, lease_token="lease-1"))
                try:
                    async for _ in stub.Decode(request, timeout=30):
                        pass
                    raise AssertionError("Decode from an unreachable prefill worker answered")
                except grpc.aio.AioRpcError as exc:
                    error = exc
                stats = await stub.Stats(worker_pb2.StatsRequest(), timeout=5)
                return error, stats
        finally:
            await server.stop()

    error, stats = asyncio.run(run())
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "kv transfer failed" in error.details() and "unreachable" in error.details()
    assert stats.kv_transfer_failures == 1 and stats.kv_transfers == 0
    assert stats.num_blocks_used == 0 and stats.num_running == 0
