"""A real prefill worker and real decode workers (tiny model, tcp KV backend), each behind its gRPC
server in this process, and the router's side of a lease: prefill one prompt, decode it with
the lease's handle, read a worker's stats (tests/decode_worker/test_lease_handoff.py and the
tests that refuse, lose or secure what it moves)."""

import contextlib

from pdserve.decode_worker.server import start as start_decode
from pdserve.decode_worker.worker import DecodeWorker
from pdserve.prefill_worker.server import start as start_prefill
from pdserve.prefill_worker.config import PrefillWorkerConfig
from pdserve.prefill_worker.worker import PrefillWorker
from pdserve.protos import pdserve_pb2, worker_pb2, worker_pb2_grpc
from pdserve.wire.grpc_util import aio_channel
from tests.factories import decode_worker_config, make_engine, random_prompts

PROMPT = random_prompts(1, [40], seed=11)[0]  # 3 blocks of 16
SAMPLING = pdserve_pb2.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@contextlib.asynccontextmanager
async def cluster(model_dir, decode_blocks=(64,), lease_seconds=30.0, tls=None, owner_timeout_s=10.0):
    """A prefill worker and decode workers (the first ones with ``decode_blocks`` blocks); with
    ``tls`` (role -> its certificate), mTLS on the internal plane: each worker has its role's
    identity, and this test's channels the router's (``prefill.decode_stub``: the decode's)."""
    tls = tls or {}
    prefill = PrefillWorker(PrefillWorkerConfig(kv_transfer_backend="tcp", lease_seconds=lease_seconds,
                                                tls=tls.get("prefill"),
                                                owner_timeout_s=owner_timeout_s),
                            engine=make_engine(model_dir, num_blocks=64))
    servers = [await start_prefill(prefill.config, prefill)]
    decoders = []
    for i, n in enumerate(decode_blocks):
        d = DecodeWorker(decode_worker_config(worker_id=f"decode-{i}", kv_transfer_backend="tcp", tls=tls.get("decode")),
                         engine=make_engine(model_dir, num_blocks=n))
        decoders.append(d)
        servers.append(await start_decode(d.config, d))
    channels = [aio_channel(s.address, tls.get("router"), peer=peer) for s, peer in zip(servers, ["prefill"] + ["decode"] * len(decoders))]
    channels.append(aio_channel(servers[0].address, tls.get("decode"), peer="prefill"))
    prefill.decode_stub = worker_pb2_grpc.PrefillWorkerStub(channels[-1])
    try:
        yield (prefill, worker_pb2_grpc.PrefillWorkerStub(channels[0]),
               decoders, [worker_pb2_grpc.DecodeWorkerStub(c) for c in channels[1:-1]])
    finally:
        for c in channels:
            await c.close()
        for s in servers:
            await s.stop()


async def prefill_one(stub, rid="client-a#0", prompt=PROMPT, router_id="") -> worker_pb2.PrefillResponse:
    return await stub.Prefill(worker_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt,
                                                        sampling=SAMPLING, router_id=router_id), timeout=60)


async def decode(stub, pre, kv=None, rid="client-a#0") -> list[int]:
    request = worker_pb2.DecodeRequest(request_id=rid, prompt_token_ids=PROMPT, first_token_id=pre.first_token_id,
                                       sampling=SAMPLING, kv=kv or pre.kv)  # max_tokens counts the first token
    tokens = []
    async for resp in stub.Decode(request, timeout=60):
        tokens += resp.token_ids
    return tokens


async def stats(stub) -> worker_pb2.WorkerStats:
    return await stub.Stats(worker_pb2.StatsRequest(), timeout=5)
