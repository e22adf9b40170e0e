"""Real prefill and decode workers behind their real gRPC servers in this process, with a router's
pool of stubs to them (``serving``), and the wait until every lease has ended and every block
is free (``settle``), and greedy tokens through the router's request run (``generate``)."""

import asyncio
import contextlib

from pdserve.decode_worker.server import start as start_decode
from pdserve.decode_worker.worker import DecodeWorker
from pdserve.prefill_worker.server import start as start_prefill
from pdserve.prefill_worker.worker import PrefillWorker
from pdserve.protos import worker_pb2, worker_pb2_grpc
from pdserve.engine.sampling.params import SamplingParams
from pdserve.router.frontend import ModelInfo, PreparedRequest
from pdserve.router.limits import RouterLimits
from pdserve.router.pool import WorkerClient, WorkerPool
from pdserve.router.request_run import RequestRun
from pdserve.wire.grpc_util import aio_channel


@contextlib.asynccontextmanager
async def serving(prefill: PrefillWorker, decoders: list[DecodeWorker], router_tls=None):
    """The workers behind their gRPC servers, and a router's pool of stubs to them (each with
    64 blocks, as its stats would say; with ``router_tls``, the router's certificate, over mTLS);
    everything stops on the way out."""
    servers = [await start_prefill(prefill.config, prefill)]
    servers += [await start_decode(d.config, d) for d in decoders]
    roles = ["prefill"] + ["decode"] * len(decoders)
    channels = [aio_channel(s.address, router_tls, peer=role) for s, role in zip(servers, roles)]
    pool = WorkerPool()
    for role, server, channel in zip(roles, servers, channels):
        stub = (worker_pb2_grpc.PrefillWorkerStub if role == "prefill" else worker_pb2_grpc.DecodeWorkerStub)(channel)
        pool.workers[server.address] = WorkerClient(role, server.address, channel=channel, stub=stub, healthy=True,
                                                    stats=worker_pb2.WorkerStats(num_blocks_total=64))
    try:
        yield pool
    finally:
        for c in channels:
            await c.close()
        for s in servers:
            await s.stop()


async def settle(prefill: PrefillWorker, decoders: list[DecodeWorker]) -> None:
    """Wait until every lease has ended and every block is free (the last read's notice
    frees the holder's copy): fails if anything stays stranded."""
    def used(worker) -> int:
        return worker.engine.blocks.num_blocks - worker.engine.blocks.num_free_blocks

    for _ in range(200):
        if not prefill.leases and not used(prefill) and not any(used(d) for d in decoders):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"stranded: {len(prefill.leases)} leases, {used(prefill)} prefill blocks, "
                         f"{[used(d) for d in decoders]} decode blocks")


async def generate(pool: WorkerPool, rid: str, prompt: list[int], max_tokens: int, stream_kv: bool = False) -> list[int]:
    """Greedy tokens of ``prompt`` through the router's request run, which must not migrate."""
    from tests.metrics.metrics_helpers import LetterTokenizer

    model = ModelInfo("smollm2", config=None, max_model_len=4096, block_size=16, tokenizer=LetterTokenizer())
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    run = RequestRun(PreparedRequest(rid, list(prompt), params), model, pool,
                     RouterLimits(stream_kv_min_tokens=1 if stream_kv else 0))
    tokens = [t for resp in [r async for r in run.responses()] for t in resp.token_ids]
    assert run.migrations == 0
    return tokens


def pool_per_decoder(pool: WorkerPool) -> list[WorkerPool]:
    """Per decode worker of ``pool`` (in the order ``serving`` started them), a pool of it and
    the prefill worker."""
    decoders = [a for a, c in pool.workers.items() if c.role == "decode"]
    pools = []
    for address in decoders:
        one = WorkerPool()
        for a, c in pool.workers.items():
            if c.role == "prefill" or a == address:
                one.workers[a] = c
        pools.append(one)
    return pools
