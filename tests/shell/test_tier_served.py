"""Workers with a KV tier, served over gRPC (tiny model, tcp KV agent).

A prefill worker's Stats carry the tier's fields (WorkerStats 55-61) and its cache events the
tier's stores (``in_tier``), which the router's index reads into tier tokens; a revisited prompt
whose blocks were evicted is then found in the tier, and the same tokens come back. A decode
worker that joins a directory another engine filled announces those blocks in its first poll,
and a prompt it prefills itself loads them from the tier as a prefill worker's prompt does."""

import asyncio
import dataclasses

from pdserve.decode_worker.server import start as start_decode
from pdserve.decode_worker.worker import DecodeWorker
from pdserve.engine.config import MIXED, KVTierConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.loader import load_model
from pdserve.engine.sampling.params import SamplingParams
from pdserve.prefill_worker.server import start
from pdserve.prefill_worker.worker import PrefillWorker
from pdserve.protos import pdserve_pb2, worker_pb2, worker_pb2_grpc
from pdserve.router.kv_index import KVIndex
from pdserve.wire.grpc_util import aio_channel
from tests.factories import decode_worker_config, engine_config, prefill_worker_config, random_prompts
from tests.helpers.engine_runs import run
from tests.helpers.local_prefill import local_request

BS = 16


def tier_engine(model_dir, directory, **scheduler) -> LLMEngine:
    """8 blocks: one 5-block prompt and its first token fill most of it, the next evicts it."""
    config = dataclasses.replace(engine_config(model_dir, num_blocks=8, block_size=BS, **scheduler),
                                 kv_tier=KVTierConfig(64 << 20, str(directory)))
    model, model_cfg, model_dir = load_model(config.model, config.torch_dtype(), config.torch_device(), progress=False)
    return LLMEngine(model, model_cfg, config, model_dir=str(model_dir))


def request(rid: str, prompt) -> worker_pb2.PrefillRequest:
    return worker_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt,
                                     sampling=pdserve_pb2.SamplingParams(max_tokens=4, temperature=0.0))


def test_a_served_tier_reports_its_stores_and_serves_a_revisit_from_them(tiny_llama_dir, tmp_path):
    engine = tier_engine(tiny_llama_dir[0], tmp_path)
    worker = PrefillWorker(prefill_worker_config(kv_transfer_backend="tcp"), engine=engine)
    first, second = random_prompts(2, [5 * BS + 3], seed=58)
    index = KVIndex()

    async def prefill(stub, rid, prompt):
        answer = await stub.Prefill(request(rid, prompt), timeout=120)
        await stub.Release(worker_pb2.ReleaseRequest(lease_token=answer.kv.lease_token), timeout=5)
        return answer

    async def poll(stub):
        epoch, after = index.cursor("w")
        stats = await stub.Stats(worker_pb2.StatsRequest(router_id="r", cache_events=True, cache_epoch=epoch,
                                                         cache_events_after=after), timeout=5)
        index.apply("w", stats.cache_events, stats.block_size, stats.kv_tier_id)
        return stats

    async def main():
        server = await start(worker.config, worker)
        try:
            async with aio_channel(server.address) as channel:
                stub = worker_pb2_grpc.PrefillWorkerStub(channel)
                await poll(stub)  # the router's first poll: a snapshot, nothing in the tier yet
                a = await prefill(stub, "a", first)
                await prefill(stub, "b", second)  # evicts a's blocks: they move down to the tier
                moved = await poll(stub)
                cached = index.overlaps(first, ["w"])
                tiered = index.tier_tokens(first, cached)
                again = await prefill(stub, "c", first)
                after = await poll(stub)
                return a, moved, cached, tiered, again, after
        finally:
            await server.drain(5)

    a, moved, cached, tiered, again, after = asyncio.run(main())
    assert moved.kv_tier_id == engine.kv_tier.tier_id and moved.kv_tier_capacity_bytes == 64 << 20
    assert moved.kv_tier_blocks_offloaded >= 1 and moved.kv_tier_bytes_used > 0
    assert cached["w"] + tiered["w"] == 5 * BS and tiered["w"] > 0  # every full block: memory, then the tier
    assert again.first_token_id == a.first_token_id  # the same token from loaded KV
    assert again.num_cached_tokens == 5 * BS
    assert after.prefix_cache_tier_hits == tiered["w"] and after.kv_tier_blocks_loaded == tiered["w"] // BS
    assert after.kv_tier_corrupt_blocks == 0


def test_a_decode_worker_joining_a_filled_tier_announces_it_and_prefills_locally_from_it(tiny_llama_dir, tmp_path):
    first, second = random_prompts(2, [5 * BS + 3, 7 * BS + 3], seed=59)
    filler = tier_engine(tiny_llama_dir[0], tmp_path)  # another worker of the host, gone since
    computed, _ = run(filler, "a", first, SamplingParams(max_tokens=4, ignore_eos=True))
    run(filler, "b", second, SamplingParams(max_tokens=1))  # takes all 8 blocks: a's go down to the tier
    filler.close()
    engine = tier_engine(tiny_llama_dir[0], tmp_path, policy=MIXED)
    config = decode_worker_config(worker_id="decode-tier", kv_transfer_backend="tcp")
    worker = DecodeWorker(config, engine=engine)
    index = KVIndex()

    async def poll(stub):
        stats = await stub.Stats(worker_pb2.StatsRequest(router_id="r", cache_events=True), timeout=5)
        index.apply("d", stats.cache_events, stats.block_size, stats.kv_tier_id)
        return stats

    async def main():
        server = await start_decode(config, worker)
        try:
            async with aio_channel(server.address) as channel:
                stub = worker_pb2_grpc.DecodeWorkerStub(channel)
                await poll(stub)  # the first poll: nothing computed here yet
                tiered = index.tier_tokens(first, index.overlaps(first, ["d"]))
                answers = [r async for r in stub.Decode(local_request("c", first, max_tokens=4), timeout=120)]
                return tiered, answers, await poll(stub)
        finally:
            await server.drain(5)

    tiered, answers, after = asyncio.run(main())
    assert tiered == {"d": 5 * BS}  # announced from the directory's file names
    prefilled = answers[0].prefilled
    assert [prefilled.first_token_id] + [t for r in answers[1:] for t in r.token_ids] == computed
    assert prefilled.num_cached_tokens == 5 * BS  # every full block loaded, none computed
    assert after.prefix_cache_tier_hits == 5 * BS and after.kv_tier_blocks_loaded == 5
