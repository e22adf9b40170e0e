"""Conversations keep their KV on the decode worker (the ``decode_kv_reuse`` setting, issue 44).

- A decode worker publishes its prefix-cache events in ``Stats``, as a prefill worker does, and
  keeps a finished stream's blocks: the next turn (prompt + answer + a new message) finds every
  full block of the prompt and the answer but the last sampled token, which was never computed.
  Real decode workers (tiny model, float32) behind their gRPC servers, prefilling locally.
- An elastic worker's two roles publish one log (one epoch) of its one cache.
- A remote-prefilled next turn reads only the blocks past the decode worker's own cache, and
  decodes the tokens a full read does: the default model in float32 and in bfloat16 (its KV
  computed here while decoding, the rest by the prefill worker), a real prefill worker and
  two real decode workers (reuse on and off) behind their gRPC servers, NIXL, the KV read whole
  and streamed chunk by chunk; the router is the real request run.
"""

import asyncio

import pytest

from pdserve.decode_worker.server import start
from pdserve.decode_worker.worker import DecodeWorker
from pdserve.elastic_worker.worker import ElasticWorker, ElasticWorkerConfig
from pdserve.engine.core.block_manager import prompt_block_hashes
from pdserve.engine.config import MIXED
from pdserve.engine.loader import materialize
from pdserve.engine.tokenizer import Tokenizer
from pdserve.prefill_worker.worker import PrefillWorker
from pdserve.protos import worker_pb2, worker_pb2_grpc
from pdserve.wire.grpc_util import aio_channel
from tests.helpers.local_prefill import local_request
from tests.factories import (decode_worker_config, engine_config, make_engine, prefill_worker_config,
                             random_prompts)
from tests.helpers.worker_servers import generate, pool_per_decoder as _pool_per_decoder, serving

BLOCK = 16


async def local_turn(stub, rid: str, prompt: list[int], max_tokens: int) -> tuple[list[int], int]:
    """One turn prefilled on the decode worker: its tokens, and the prompt tokens its cache had."""
    resps = [r async for r in stub.Decode(local_request(rid, prompt, max_tokens), timeout=60)]
    first = resps[0].prefilled
    return [first.first_token_id] + [t for r in resps[1:] for t in r.token_ids], first.num_cached_tokens


def test_a_decode_worker_publishes_its_blocks_and_the_next_turn_finds_prompt_and_answer(tiny_llama_dir):
    prompt, message = random_prompts(2, [37, 9], seed=5)
    answer_tokens = 28  # prompt + answer - 1 = 64 tokens computed: 4 full blocks, the last token in the 5th
    workers = [DecodeWorker(decode_worker_config(worker_id=f"decode-{reuse}", decode_kv_reuse=reuse),
                            engine=make_engine(tiny_llama_dir[0], num_blocks=64, policy=MIXED))
               for reuse in (True, False)]

    async def conversation(worker):
        server = await start(worker.config, worker)
        try:
            async with aio_channel(server.address) as channel:
                stub = worker_pb2_grpc.DecodeWorkerStub(channel)
                answer, _ = await local_turn(stub, "turn-1", prompt, answer_tokens)
                stats = await stub.Stats(worker_pb2.StatsRequest(cache_events=True), timeout=5)
                _, cached = await local_turn(stub, "turn-2", prompt + answer + message, 4)
                return answer, stats, cached
        finally:
            await server.stop()

    (answer, stats, cached), (answer_off, stats_off, cached_off) = [asyncio.run(conversation(w)) for w in workers]
    assert answer == answer_off and len(answer) == answer_tokens
    # Every full block of prompt + answer but the last sampled token: published and found.
    kept = prompt_block_hashes(prompt + answer + message, BLOCK)[:4]
    events = stats.cache_events
    assert events.snapshot and events.epoch and set(kept) <= set(events.block_hashes) and stats.block_size == BLOCK
    assert cached == cached_off == 4 * BLOCK
    assert not stats_off.HasField("cache_events")  # reuse off: publishes nothing, as before


def test_an_elastic_worker_publishes_one_log_of_its_one_cache_whichever_role_is_polled(tiny_llama_dir):
    engine = engine_config(tiny_llama_dir[0], num_blocks=32)
    for reuse in (True, False):
        config = ElasticWorkerConfig(
            prefill=prefill_worker_config(worker_id="elastic-0", kv_transfer_backend="tcp", engine=engine),
            decode=decode_worker_config(worker_id="elastic-0", kv_transfer_backend="tcp", engine=engine,
                                        decode_kv_reuse=reuse))
        worker = ElasticWorker(config)
        try:
            blocks = worker.engine.blocks
            blocks.allocate("r", list(range(3, 3 + 2 * BLOCK)))
            blocks.mark_final("r", list(range(3, 3 + 2 * BLOCK)), 2 * BLOCK)
            prefill = worker.prefill.cache_events("", 0)
            decode = worker.decode.cache_events("", 0)
            assert prefill.hashes and worker.prefill.cache_log.last_seq == 2  # each event recorded once
            if reuse:
                assert decode == prefill  # one epoch, one numbering, the same hashes
            else:
                assert decode is None
        finally:
            worker.agent.close()
            worker.engine.close()


TEXT = ("The lighthouse keeper climbed the stairs every evening to light the lamp. One stormy night "
        "a ship appeared on the horizon, its sails torn, drifting toward the rocks below the cliff.")
FOLLOW_UP = " What did the keeper do next, and why?"
ANSWER, NEXT = 24, 12


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_next_turn_reads_only_the_blocks_past_the_decode_workers_cache_and_decodes_as_a_full_read(dtype):
    model_dir = materialize("default", progress=False)
    tok = Tokenizer(model_dir)
    prompt, message = tok.encode(TEXT), tok.encode(FOLLOW_UP)

    def decode_worker(reuse: bool) -> DecodeWorker:
        return DecodeWorker(decode_worker_config(worker_id=f"decode-{reuse}", kv_transfer_backend="nixl",
                                                 decode_kv_reuse=reuse),
                            engine=make_engine(model_dir, dtype=dtype, num_blocks=64))

    # No prefix cache on the prefill worker: it computes every turn in chunks (streamed KV
    # then has early reads), so only the decode worker's cache saves reads.
    prefill = PrefillWorker(prefill_worker_config(kv_transfer_backend="nixl"),
                            engine=make_engine(model_dir, dtype=dtype, num_blocks=64, max_num_batched_tokens=32,
                                               enable_prefix_cache=False))
    reusing, full = decode_worker(True), decode_worker(False)
    block_bytes = reusing.engine.cache_spec.bytes_per_token * BLOCK

    def read(worker) -> int:
        return worker.agent.stats.snapshot().bytes

    async def main():
        async with serving(prefill, [reusing, full]) as pool:
            pools = _pool_per_decoder(pool)
            answer = await generate(pools[0], "turn-1", prompt, ANSWER)
            second = prompt + answer + message
            out = {}
            # Streamed first: it finds turn 1's blocks; the whole read after it finds its own too.
            for name, i, stream_kv in [("full", 1, False), ("streamed", 0, True), ("whole", 0, False)]:
                worker = (reusing, full)[i]
                before = read(worker)
                tokens = await generate(pools[i], name, second, NEXT, stream_kv)
                out[name] = tokens, read(worker) - before
            return answer, second, out, prefill.leases.released_by

    answer, second, out, released_by = asyncio.run(main())
    assert len(answer) == ANSWER
    n = -(-len(second) // BLOCK)
    tail = block_bytes  # the partly filled last block moves whole (CacheSpec.tail_bytes)
    kept = (len(prompt) + ANSWER - 1) // BLOCK  # turn 1's full blocks: prompt and answer but its last token
    assert 0 < kept < n - 1
    assert out["full"][1] == (n - 1) * block_bytes + tail
    assert out["streamed"][1] == (n - 1 - kept) * block_bytes + tail  # only what the decode worker lacked
    assert out["whole"][1] == tail  # the streamed turn's blocks are kept too: all but the last
    assert out["whole"][0] == out["streamed"][0] == out["full"][0] and len(out["full"][0]) == NEXT
    assert released_by["pulled"] == 4 and released_by["transfer_failed"] == 0  # every lease ended by its read
