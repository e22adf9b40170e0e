"""A decode worker told to pull from a prefill worker that does not answer: the client of the
RPC (the router) gets UNAVAILABLE, the failed transfer is counted, and no block stays taken;
the requests that read from other prefill workers go on meanwhile. Real decode (and prefill)
workers (tiny model) behind their real gRPC servers."""

import asyncio
import socket

import grpc

from pdserve.decode_worker.server import start
from pdserve.decode_worker.worker import DecodeWorker
from pdserve.prefill_worker.server import start as start_prefill
from pdserve.prefill_worker.worker import PrefillWorker
from pdserve.protos import pdserve_pb2, worker_pb2, worker_pb2_grpc
from tests.factories import decode_worker_config, make_engine, prefill_worker_config
from pdserve.wire.grpc_util import aio_channel


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nobody listens once the socket closes


def test_an_unreachable_prefill_worker_is_a_counted_transfer_failure(tiny_llama_dir):
    config = decode_worker_config(worker_id="decode-unreachable")
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


def test_a_prefill_worker_that_never_answers_holds_up_only_the_requests_that_read_from_it(tiny_llama_dir):
    """The decode worker learns each prefill worker's metadata once, under a lock per address:
    while a silent one (it accepts the connection and never speaks) keeps its metadata call
    waiting, a request whose KV is on a healthy prefill worker is served. The old lock was one
    for every peer, held across that call: the healthy request waited the silent one's 10 s."""
    from tests.helpers.lease_workers import decode, prefill_one

    model_dir = tiny_llama_dir[0]
    p_config = prefill_worker_config(kv_transfer_backend="tcp")
    d_config = decode_worker_config(worker_id="decode-0", kv_transfer_backend="tcp")
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # the kernel completes the handshake; nobody ever answers
    silent.settimeout(30)  # only a bound against a hang

    async def run():
        prefill = await start_prefill(p_config, PrefillWorker(p_config, engine=make_engine(model_dir, num_blocks=64)))
        decoder = await start(d_config, DecodeWorker(d_config, engine=make_engine(model_dir, num_blocks=64)))
        try:
            async with aio_channel(prefill.address) as p_ch, aio_channel(decoder.address) as d_ch:
                p_stub, d_stub = worker_pb2_grpc.PrefillWorkerStub(p_ch), worker_pb2_grpc.DecodeWorkerStub(d_ch)
                request = worker_pb2.DecodeRequest(
                    request_id="stuck#0", prompt_token_ids=list(range(3, 23)), first_token_id=5,
                    sampling=pdserve_pb2.SamplingParams(max_tokens=4),
                    kv=worker_pb2.KVHandle(prefill_address=f"127.0.0.1:{silent.getsockname()[1]}",
                                           block_ids=[0, 1], num_tokens=20, lease_token="lease-1"))
                stuck = asyncio.create_task(_ended(d_stub.Decode(request, timeout=60)))
                accepted, _ = await asyncio.to_thread(silent.accept)  # its metadata call is in flight now
                pre = await prefill_one(p_stub)
                tokens = await decode(d_stub, pre)
                waiting = not stuck.done()
                error = await stuck
                accepted.close()
                return tokens, waiting, error
        finally:
            await decoder.stop()
            await prefill.stop()

    try:
        tokens, still_waiting, error = asyncio.run(run())
    finally:
        silent.close()
    assert len(tokens) == 5  # the healthy request was served ...
    assert still_waiting  # ... while the silent peer's metadata call still waited
    assert error.code() == grpc.StatusCode.UNAVAILABLE and "unreachable" in error.details()


async def _ended(call) -> grpc.aio.AioRpcError | None:
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as exc:
        return exc
    return None
