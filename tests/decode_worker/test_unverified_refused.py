"""Verification fails closed: a decode worker that verifies KV (``verify_kv``) never reads KV its
holder sent without checksums, and the router never pairs the two where it knows their
settings differ. A real prefill worker with verification off and a real decode worker with it on
(the tiny Llama, float32, NIXL), behind their gRPC servers in this process; the router is the
real request run over a pool of stubs to them, whose stats say what the router believes of each
worker's setting.

The holder changes a byte of the prompt's first block when its lease is final (where a verifying
holder would have summed it): a block reused under a late read, a memory fault. Nothing of it
may reach the client: the tokens equal those of a run where both verify."""

import asyncio
import contextlib

import pytest
import torch

from pdserve.decode_worker.worker import DecodeWorker
from pdserve.engine.sampling.params import SamplingParams
from pdserve.prefill_worker.worker import PrefillWorker
from pdserve.protos import worker_pb2
from pdserve.router.frontend import ModelInfo, PreparedRequest
from pdserve.router.limits import RouterLimits
from pdserve.router.request_run import RequestRun
from tests.factories import decode_worker_config, make_engine, prefill_worker_config, random_prompts
from tests.helpers.worker_servers import serving, settle
from tests.metrics.metrics_helpers import LetterTokenizer, sample

pytestmark = pytest.mark.slow

BLOCK, BLOCKS, MAX_TOKENS = 16, 64, 8
SPOILED = 512  # bytes of the first block whose every fourth one changes (the first token's K, in part)
PROMPT = random_prompts(1, [45], seed=55)[0]  # 3 blocks, the last partly filled


@contextlib.asynccontextmanager
async def workers(model_dir, holder_verifies: bool, seen: tuple[bool, bool], reader_verifies: bool = True):
    """A prefill worker (``holder_verifies``, no prefix cache) and a decode worker
    (``reader_verifies``), and a pool whose stats say ``seen`` (the prefill's, the decode's setting)."""
    prefill = PrefillWorker(prefill_worker_config(verify_kv=holder_verifies),
                            engine=make_engine(model_dir, num_blocks=BLOCKS, enable_prefix_cache=False))
    decoder = DecodeWorker(decode_worker_config(verify_kv=reader_verifies), engine=make_engine(model_dir, num_blocks=BLOCKS))
    async with serving(prefill, [decoder]) as pool:
        for client in pool.workers.values():
            client.stats = worker_pb2.WorkerStats(num_blocks_total=BLOCKS,
                                                  verify_kv=seen[0] if client.role == "prefill" else seen[1])
        yield prefill, decoder, pool


def flip_when_final(prefill: PrefillWorker) -> list[int]:
    """Once: as the holder's lease becomes final (its checksums would be taken now), invert a byte
    of the lease's first block in its cache. Returns the list the block's id goes into."""
    final, flipped = prefill._checksum_final, []

    def checksum_final(lease, num_tokens, done):
        if done and not flipped:
            cache = prefill.engine.kv_cache
            block = cache.view(cache.shape[0], -1).view(torch.uint8)[lease.block_ids[0]]
            block[3:SPOILED:4] ^= 0xFF  # the sign and exponent byte of each of its first float32s
            flipped.append(lease.block_ids[0])
        final(lease, num_tokens, done)

    prefill._checksum_final = checksum_final
    return flipped


async def generate(pool, rid: str, stream_kv: bool = False) -> tuple[list[int], RequestRun]:
    model = ModelInfo("tiny", config=None, max_model_len=4096, block_size=BLOCK, tokenizer=LetterTokenizer())
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    run = RequestRun(PreparedRequest(rid, list(PROMPT), params), model, pool,
                     RouterLimits(stream_kv_min_tokens=1 if stream_kv else 0))
    tokens = [t for resp in [r async for r in run.responses()] for t in resp.token_ids]
    return tokens, run


async def served(model_dir, holder_verifies: bool, seen: tuple[bool, bool], reader_verifies: bool = True,
                 stream_kv: bool = False):
    """One request: its tokens and run, whether the holder's byte changed, the decode worker's
    stats and its KV agent's reads, and the prefill worker's forward tokens (0: never prefilled)."""
    async with workers(model_dir, holder_verifies, seen, reader_verifies) as (prefill, decoder, pool):
        flipped = flip_when_final(prefill) if not holder_verifies else []
        before = sample("pdserve:local_prefill_decisions_total", reason="verify_mismatch")
        tokens, run = await generate(pool, "unverified", stream_kv)
        await settle(prefill, [decoder])  # nothing held or stranded on either side
        d_stub = next(c.stub for c in pool.workers.values() if c.role == "decode")
        stats = await d_stub.Stats(worker_pb2.StatsRequest(), timeout=5)
        metric = sample("pdserve:kv_unverified_refused_total", pool="decode", worker=decoder.config.worker_id)
        placed = sample("pdserve:local_prefill_decisions_total", reason="verify_mismatch") - before
        return (tokens, run, flipped, stats, metric, placed, decoder.agent.stats.snapshot(),
                prefill.engine.runner.num_forward_tokens)


@pytest.fixture(scope="module")
def verified(tiny_llama_dir) -> list[int]:
    """The tokens where both workers verify: read from the prefill worker, checked, decoded."""
    tokens, run, _, stats, _, _, reads, _ = asyncio.run(served(tiny_llama_dir[0], True, (True, True)))
    assert run.migrations == 0 and reads.transfers == 1 and stats.kv_unverified_refused == 0
    assert stats.verify_kv  # advertised
    return tokens


def test_kv_without_checksums_is_refused_unread_and_the_decode_worker_prefills_it_to_the_verified_tokens(
        tiny_llama_dir, verified):
    model_dir = tiny_llama_dir[0]

    # The router believes the holder verifies (a stale view: its restart with the setting off
    # not yet polled): the pair is made, and the reader refuses what comes without checksums.
    tokens, run, flipped, stats, metric, placed, reads, _ = asyncio.run(served(model_dir, False, (True, True)))
    assert flipped  # the holder's byte did change
    assert tokens == verified  # never decoded: the decode worker prefilled prompt + first token itself
    assert run.migrations == 1 and placed == 1  # the lost attempt, then a local prefill (verify_mismatch)
    assert stats.kv_unverified_refused == 1 and metric == 1
    # Nothing was read from the holder: no byte of it is in the decode worker's cache, so none
    # is published, found or summed again for another reader.
    assert (reads.transfers, reads.failures, reads.bytes) == (0, 0, 0)

    # The control: a reader that does not verify reads the same holder, and the changed bytes
    # reach the client. Only the refusal above kept them out.
    spoiled, run, flipped, *_, reads, _ = asyncio.run(served(model_dir, False, (False, False), reader_verifies=False))
    assert flipped and reads.transfers == 1 and run.migrations == 0
    assert spoiled[0] == verified[0] and spoiled != verified  # the first token is the prefill worker's


def test_the_router_never_pairs_a_holder_and_a_reader_that_disagree(tiny_llama_dir, verified):
    """Where the stats say the settings differ, the request is prefilled on the decode worker
    from the start: no prefill, no refusal, no migration, the verified tokens."""
    model_dir = tiny_llama_dir[0]
    tokens, run, flipped, stats, _, placed, reads, prefill_tokens = asyncio.run(served(model_dir, False, (False, True)))
    assert tokens == verified and run.migrations == 0 and placed == 1
    assert not flipped and prefill_tokens == 0  # the prefill worker never saw it
    assert stats.kv_unverified_refused == 0 and reads.transfers == 0


def test_streamed_kv_without_checksums_is_refused_at_its_first_read(tiny_llama_dir, verified):
    """Streamed KV (read chunk by chunk while the prompt computes): the first read that would
    start without checksums is refused; nothing is read, and the decode worker prefills it."""
    tokens, run, _, stats, _, placed, reads, _ = asyncio.run(
        served(tiny_llama_dir[0], False, (True, True), stream_kv=True))
    assert tokens == verified and run.migrations == 1 and placed == 1
    assert stats.kv_unverified_refused == 1 and reads.transfers == 0 and reads.bytes == 0
