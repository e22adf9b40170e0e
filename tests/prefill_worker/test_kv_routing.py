"""KV-aware routing through real workers (tiny float32 model, gRPC servers and the tcp KV
backend in this process) and the router's real pool and request path: the router sends a
shared prefix back to the worker that caches it, the worker reuses it, and the output equals
transformers token for token; when the index is stale (the worker evicted the prefix since
the last poll) the request still goes there, misses, and the output is still exact."""

import asyncio

import pytest
import torch

from pdserve.engine.sampling.params import SamplingParams
from pdserve.kv_transfer.handoff import ReleaseReason
from pdserve.protos import worker_pb2
from pdserve.router.frontend import ModelInfo, PreparedRequest
from pdserve.router.kv_index import prompt_block_hashes
from pdserve.router.kv_policy import RoutingConfig
from pdserve.router.request_run import RequestRun
from pdserve.router.limits import RouterLimits
from pdserve.router.pool import WorkerPool
from tests.factories import assert_greedy_matches, load_reference, random_prompts
from tests.helpers.kv_routing import BLOCK, QUESTIONS, SYSTEM, cluster
from tests.metrics.metrics_helpers import LetterTokenizer, sample

pytestmark = pytest.mark.slow

MAX_TOKENS = 6


async def generate(pool: WorkerPool, prompt: list[int], rid: str) -> tuple[list[int], int]:
    """One request through the router's request path: (tokens, prompt tokens the worker had cached)."""
    model = ModelInfo("tiny", config=None, max_model_len=2048, block_size=BLOCK, tokenizer=LetterTokenizer())
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    run = RequestRun(PreparedRequest(rid, prompt, params), model, pool, RouterLimits(routing=RoutingConfig()))
    tokens = [t async for resp in run.responses() for t in resp.token_ids]
    return tokens, run.output.cached_tokens


def test_a_shared_prefix_goes_to_the_worker_that_caches_it_and_output_is_exact(tiny_llama_dir):
    model_dir = tiny_llama_dir[0]
    first, second = SYSTEM + QUESTIONS[0], SYSTEM + QUESTIONS[1]

    async def run():
        async with cluster(model_dir, prefill_blocks=64) as (pool, prefills):
            out1 = await generate(pool, first, "r1")
            await pool.refresh()  # the poll brings the worker's cache events
            choice = pool.route_prefill(second, RoutingConfig())
            hits = sample("pdserve:routing_decisions_total", reason="cache")
            out2 = await generate(pool, second, "r2")
            stub = pool.workers[choice.worker_id].stub
            plain = await stub.Stats(worker_pb2.StatsRequest(), timeout=5)  # the supervisor's liveness poll
            asked = await stub.Stats(worker_pb2.StatsRequest(cache_events=True), timeout=5)
            return (out1, choice, out2, sample("pdserve:routing_decisions_total", reason="cache") - hits, prefills,
                    (plain, asked))

    (tokens1, cached1), choice, (tokens2, cached2), cache_decisions, prefills, (plain, asked) = asyncio.run(run())
    assert not plain.HasField("cache_events")  # only pollers that ask get events
    assert asked.cache_events.snapshot and set(prompt_block_hashes(second, BLOCK)) <= set(
        asked.cache_events.block_hashes) and asked.block_size == BLOCK
    assert cached1 == 0
    assert (choice.rule, choice.cached_tokens) == ("cache", 3 * BLOCK)
    holder = prefills[choice.worker_id]
    assert holder.engine.blocks.prefix_hits == 3 * BLOCK  # the worker found all three blocks (tokens)
    assert cached2 == 3 * BLOCK and cache_decisions == 1
    reference = load_reference(model_dir, torch.float32)
    assert_greedy_matches(reference, first, tokens1, MAX_TOKENS, what="cold prompt")
    assert_greedy_matches(reference, second, tokens2, MAX_TOKENS, what="prefix hit")


def test_a_stale_index_pointing_at_an_evicted_prefix_costs_a_miss_not_a_wrong_token(tiny_llama_dir):
    model_dir = tiny_llama_dir[0]
    first, third = SYSTEM + QUESTIONS[0], SYSTEM + QUESTIONS[2]
    filler = random_prompts(1, [8 * BLOCK - 8], seed=23)[0]  # all 8 blocks of a prefill worker

    async def run():
        async with cluster(model_dir, prefill_blocks=8) as (pool, prefills):
            await generate(pool, first, "r1")
            await pool.refresh()
            holder_address = pool.route_prefill(third, RoutingConfig()).worker_id
            holder = prefills[holder_address]
            # Behind the router's back (no poll), the holder hands every block out again.
            result = await holder.prefill("filler#0", filler, SamplingParams(max_tokens=2, ignore_eos=True))
            await holder.release(result.lease.token, ReleaseReason.ABORTED)
            stale = pool.route_prefill(third, RoutingConfig())
            pending = holder.cache_events(*pool.index.cursor(holder_address))  # what the next poll brings
            tokens, cached = await generate(pool, third, "r3")
            await pool.refresh()
            again = pool.index.overlaps(third, [holder_address])
            return holder_address, stale, pending, tokens, cached, again

    holder_address, stale, pending, tokens, cached, again = asyncio.run(run())
    assert (stale.worker_id, stale.cached_tokens) == (holder_address, 3 * BLOCK)  # the index still says so
    evicted = {h for h, c in zip(pending.hashes, pending.cached) if not c}
    assert not pending.snapshot and set(prompt_block_hashes(third, BLOCK)) <= evicted
    assert cached == 0  # the worker looked, missed, and computed the whole prompt
    assert again == {holder_address: 3 * BLOCK}  # which cached the prefix there again
    assert_greedy_matches(load_reference(model_dir, torch.float32), third, tokens, MAX_TOKENS,
                          what="stale index, evicted prefix")
