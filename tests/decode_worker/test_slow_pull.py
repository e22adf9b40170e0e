"""A lease outlives its reader: a decode worker whose read of held KV starts late (here every
read is posted 2.5 s after it is asked for, past the holder's 1 s lease) keeps its claim
renewed, so the holder frees the blocks only once the read has ended. Real prefill and decode
workers (tiny model) behind their real gRPC servers in this process, over both backends.

The old holder expired a claimed lease at its deadline whoever still read it: the tcp holder
then refused the read, and a one-sided NIXL read went on in blocks the holder had freed, and
could hand to the next prompt (seen here: the read, no longer progressed by the holder,
timed out; had it completed, it would have decoded whatever the blocks held then)."""

import asyncio
import contextlib

import pytest

from pdserve.decode_worker.server import start as start_decode
from pdserve.decode_worker.worker import DecodeWorker
from pdserve.engine.sampling.params import SamplingParams
from pdserve.prefill_worker.server import start as start_prefill
from pdserve.prefill_worker.worker import PrefillWorker
from pdserve.protos import pdserve_pb2, worker_pb2, worker_pb2_grpc
from pdserve.wire.grpc_util import aio_channel
from tests.factories import decode_worker_config, make_engine, prefill_worker_config, random_prompts

pytestmark = pytest.mark.slow

PROMPTS = random_prompts(2, [40, 40], seed=31)  # 3 blocks of 16 each
MAX_TOKENS = 6
LEASE_S, TIMEOUT_S, DELAY_S = 1.0, 0.5, 2.5  # the read is posted 2.5 s after it is asked for


def expected(model_dir, prompt) -> list[int]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return make_engine(model_dir).generate([prompt], params)[0].token_ids


@contextlib.asynccontextmanager
async def pair(model_dir, backend: str, prefill_blocks: int, verify: bool = True):
    """A prefill worker holding KV under a ``LEASE_S`` lease, with ``prefill_blocks`` blocks and
    no prefix cache (a freed block is the next prompt's), and a decode worker whose every read
    starts ``DELAY_S`` late."""
    prefill = PrefillWorker(prefill_worker_config(kv_transfer_backend=backend, lease_seconds=LEASE_S, verify_kv=verify),
                            engine=make_engine(model_dir, num_blocks=prefill_blocks, enable_prefix_cache=False))
    decode = DecodeWorker(decode_worker_config(kv_transfer_backend=backend, transfer_timeout_s=TIMEOUT_S,
                                               inject_transfer_delay_s=DELAY_S, verify_kv=verify),
                          engine=make_engine(model_dir, num_blocks=64))
    servers = [await start_prefill(prefill.config, prefill), await start_decode(decode.config, decode)]
    channels = [aio_channel(s.address) for s in servers]
    try:
        yield prefill, worker_pb2_grpc.PrefillWorkerStub(channels[0]), worker_pb2_grpc.DecodeWorkerStub(channels[1])
    finally:
        for c in channels:
            await c.close()
        for s in servers:
            await s.stop()


SAMPLING = pdserve_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


async def generate(p_stub, d_stub, rid: str, prompt: list[int], prefilled: asyncio.Event | None = None) -> list[int]:
    pre = await p_stub.Prefill(worker_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling=SAMPLING),
                               timeout=60)
    if prefilled is not None:
        prefilled.set()
    request = worker_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt, first_token_id=pre.first_token_id,
                                       sampling=SAMPLING, kv=pre.kv)
    tokens = [pre.first_token_id]
    async for resp in d_stub.Decode(request, timeout=60):
        tokens += resp.token_ids
    return tokens


@pytest.mark.parametrize("backend", ["tcp", "nixl"])
def test_a_claimed_lease_survives_past_lease_seconds_while_its_reader_still_reads(tiny_llama_dir, backend):
    model_dir = tiny_llama_dir[0]

    async def run():
        async with pair(model_dir, backend, prefill_blocks=64) as (prefill, p_stub, d_stub):
            tokens = await generate(p_stub, d_stub, "slow#0", PROMPTS[0])
            return tokens, dict(prefill.leases.released_by)

    tokens, released_by = asyncio.run(run())
    assert tokens == expected(model_dir, PROMPTS[0])
    assert released_by["expired"] == 0 and released_by["pulled"] == 1  # held 2.5 s under a 1 s lease, then read


def test_a_slow_pull_never_lets_another_requests_output_change(tiny_llama_dir):
    """The prefill worker has room for one prompt's blocks. A's KV waits for its slow read;
    B comes meanwhile and needs those blocks. B waits until A's read has ended, and each gets
    its own tokens. Checksums off, to see the lease alone keep them apart: the old holder
    expired A's lease at 1 s and prefilled B into A's blocks before A's one-sided NIXL read
    came (with checksums on, a read of B's KV fails and A re-prefills)."""
    model_dir = tiny_llama_dir[0]

    async def run():
        async with pair(model_dir, "nixl", prefill_blocks=3, verify=False) as (prefill, p_stub, d_stub):
            a_prefilled = asyncio.Event()
            a = asyncio.create_task(generate(p_stub, d_stub, "a#0", PROMPTS[0], a_prefilled))
            await a_prefilled.wait()
            b = await generate(p_stub, d_stub, "b#0", PROMPTS[1])
            return await a, b, dict(prefill.leases.released_by)

    a, b, released_by = asyncio.run(run())
    assert a == expected(model_dir, PROMPTS[0])
    assert b == expected(model_dir, PROMPTS[1])
    assert released_by["expired"] == 0 and released_by["pulled"] == 2
