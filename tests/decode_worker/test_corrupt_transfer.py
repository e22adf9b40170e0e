"""A byte changed in transit is caught, and the request still gets its tokens: the default
model (SmolLM2-135M, bfloat16), a real prefill and a real decode worker behind their gRPC
servers in this process, over NIXL and over tcp, the whole prompt at once or streamed chunk by
chunk; the router is the real request run (``pdserve.router.request_run.RequestRun``) over a
pool of real stubs.

Where the byte changes: in the prefill worker's cache, right after the holder took the block's
checksum (on its engine thread, before the lease is handed out), so the real transport carries
the changed byte, as a block reused under a late read or a memory fault on either side would
have it. The decode worker's check fails the transfer before the engine hears the KV is ready;
it is logged with the block and the peer and counted (``pdserve:kv_verify_failures_total``);
the router re-prefills (one migration) and the tokens equal the uncorrupted run's. Prefix
caching is off on the prefill worker, so the re-prefill computes the prompt again rather than
finding the changed block. The old decode worker decoded the changed KV as it came."""

import asyncio
import contextlib
import logging
import urllib.request

import pytest
import torch

from pdserve.decode_worker.worker import DecodeWorker
from pdserve.engine.loader import materialize
from pdserve.engine.sampling.params import SamplingParams
from pdserve.engine.tokenizer import Tokenizer
from pdserve.prefill_worker.worker import PrefillWorker
from pdserve.protos import worker_pb2
from pdserve.router.frontend import ModelInfo, PreparedRequest
from pdserve.router.limits import RouterLimits
from pdserve.router.pool import WorkerPool
from pdserve.router.request_run import RequestRun
from tests.factories import decode_worker_config, make_engine, prefill_worker_config
from tests.helpers.worker_servers import serving
from tests.metrics.metrics_helpers import LetterTokenizer

pytestmark = pytest.mark.slow

BLOCK, CHUNK, MAX_TOKENS = 16, 32, 12
TEXT = ("The lighthouse keeper climbed the stairs every evening to light the lamp. One stormy night "
        "a ship appeared on the horizon, its sails torn, drifting toward the rocks below the cliff. "
        "He ran down to the harbour, woke the fishermen, and together they rowed out into the waves "
        "with ropes and lanterns, shouting to the sailors to hold on to the wreck until they came.")


@pytest.fixture(scope="module")
def model_dir():
    return materialize("default", progress=False)


@pytest.fixture(scope="module")
def prompt(model_dir) -> list[int]:
    ids = Tokenizer(model_dir).encode(TEXT)
    assert len(ids) > 2 * CHUNK and len(ids) % BLOCK  # several chunks; a partly filled last block
    return ids


@contextlib.asynccontextmanager
async def workers(model_dir, backend: str):
    """A prefill worker computing prompts in chunks of CHUNK tokens (no prefix cache) and a
    decode worker, both on the default model in bfloat16, and a router's pool of stubs."""
    prefill = PrefillWorker(prefill_worker_config(kv_transfer_backend=backend),
                            engine=make_engine(model_dir, dtype="bfloat16", num_blocks=64,
                                               max_num_batched_tokens=CHUNK, enable_prefix_cache=False))
    # The decode worker reads every block (no reuse of its own cache): the corrupted run asks the
    # clean run's prompt again, which it would otherwise find there and read only the last block of.
    decoder = DecodeWorker(decode_worker_config(kv_transfer_backend=backend, decode_kv_reuse=False),
                           engine=make_engine(model_dir, dtype="bfloat16", num_blocks=64))
    async with serving(prefill, [decoder]) as pool:
        yield prefill, decoder, pool


def flip_after_checksum(prefill: PrefillWorker) -> list[int]:
    """Once: right after the holder checksums some blocks, invert the first byte of the first
    of them in its cache. Returns the list the changed block's id goes into."""
    checksums, flipped = prefill.agent.block_checksums, []

    def block_checksums(block_ids, last_block_bytes=None):
        sums = checksums(block_ids, last_block_bytes)
        if not flipped:
            cache = prefill.engine.kv_cache
            cache.view(cache.shape[0], -1).view(torch.uint8)[block_ids[0], 1] ^= 0xFF  # K[token 0, layer 0]: sign and exponent
            flipped.append(block_ids[0])
        return sums

    prefill.agent.block_checksums = block_checksums
    return flipped


async def generate(pool: WorkerPool, rid: str, prompt: list[int], stream_kv: bool) -> tuple[list[int], RequestRun]:
    model = ModelInfo("smollm2", config=None, max_model_len=4096, block_size=BLOCK, tokenizer=LetterTokenizer())
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    run = RequestRun(PreparedRequest(rid, list(prompt), params), model, pool,
                     RouterLimits(stream_kv_min_tokens=1 if stream_kv else 0))
    tokens = [t for resp in [r async for r in run.responses()] for t in resp.token_ids]
    return tokens, run


async def settle(prefill: PrefillWorker, decoder: DecodeWorker) -> None:
    """Every lease ended and every block free on both sides (fails if anything is stranded)."""
    for _ in range(200):
        if not prefill.leases and all(w.engine.blocks.num_free_blocks == 64 for w in (prefill, decoder)):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"stranded: {len(prefill.leases)} leases")


def scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
        return resp.read().decode()


@pytest.mark.parametrize("stream_kv", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("backend", ["nixl", "tcp"])
def test_a_byte_changed_in_transit_is_caught_and_the_request_re_prefills_to_the_same_tokens(
        model_dir, prompt, caplog, backend, stream_kv):
    async def main():
        async with workers(model_dir, backend) as (prefill, decoder, pool):
            clean, clean_run = await generate(pool, "clean", prompt, stream_kv)
            await settle(prefill, decoder)
            flipped = flip_after_checksum(prefill)
            with caplog.at_level(logging.WARNING, logger="pdserve.kv_transfer.base"):
                corrupted, run = await generate(pool, "corrupted", prompt, stream_kv)
            await settle(prefill, decoder)
            d_stub = next(c.stub for c in pool.workers.values() if c.role == "decode")
            stats = await d_stub.Stats(worker_pb2.StatsRequest(), timeout=5)
            return clean, clean_run, corrupted, run, flipped, stats, scrape(stats.metrics_address)

    clean, clean_run, corrupted, run, flipped, stats, metrics = asyncio.run(main())
    assert len(clean) == MAX_TOKENS and clean_run.migrations == 0
    assert flipped  # the byte did change, after its checksum was taken
    assert corrupted == clean  # re-prefilled, the same tokens as the uncorrupted run
    assert run.migrations == 1  # the failed transfer went through the router's migration
    assert stats.kv_verify_failures == 1 and stats.kv_transfer_failures == 1
    assert f"block {flipped[0]} of peer 'prefill-0'" in caplog.text and "does not match its checksum" in caplog.text
    assert 'pdserve:kv_verify_failures_total{model_name="smollm2",pool="decode",worker="decode-0"} 1.0' in metrics
