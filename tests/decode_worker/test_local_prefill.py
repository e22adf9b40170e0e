"""A decode worker that prefills prompts itself (``DecodeRequest.local_prefill``; its stream
starts with the prefill answer, ``DecodeResponse.prefilled``): real worker (tiny model,
float32) behind its real gRPC server, no prefill worker anywhere.

Short requests stream while a long prompt arrives, so its chunks run in mixed steps beside
their decodes; every output equals transformers' greedy one, and every block is free after.
"""

import asyncio
import time

import grpc

from pdserve.decode_worker.server import start
from pdserve.decode_worker.worker import DecodeWorker, decode_engine_config
from pdserve.engine.config import MIXED
from pdserve.protos import pdserve_pb2, worker_pb2, worker_pb2_grpc
from tests.factories import assert_greedy_matches, decode_worker_config, make_engine, random_prompts
from tests.helpers.local_prefill import LONG_TOKENS, local_request
from pdserve.wire.grpc_util import aio_channel

SHORT_TOKENS = 64  # the short streams outlast the long prompt's arrival (LONG_TOKENS)


def test_a_decode_worker_engine_runs_the_mixed_policy():
    assert decode_engine_config(decode_worker_config().engine).scheduler.policy == MIXED


def test_local_prefill_mixed_with_running_streams_equals_transformers_and_frees_every_block(tiny_llama_dir):
    directory, hf = tiny_llama_dir
    # A small step budget: the 300-token prompt takes several steps, each beside the decodes.
    engine = make_engine(directory, num_blocks=64, policy=MIXED, max_num_batched_tokens=64)
    config = decode_worker_config(worker_id="decode-local")
    worker = DecodeWorker(config, engine=engine)
    short = random_prompts(3, [5, 12, 20], seed=11)
    long = random_prompts(1, [300], seed=12)[0]
    steps = []  # (decode rows, prompt tokens) of every step
    schedule = engine.scheduler.schedule

    def recording(*args):  # the engine hands schedule its proposer (None without speculation)
        out = schedule(*args)
        steps.append((sum(1 for s in out.seqs if s.seq.num_computed_tokens >= s.seq.num_prompt_tokens),
                      sum(s.num_new_tokens for s in out.seqs
                          if s.seq.seq_id == "long" and s.seq.num_computed_tokens < s.seq.num_prompt_tokens)))
        return out

    engine.scheduler.schedule = recording

    async def stream(stub, rid, prompt, **sampling):
        return [r async for r in stub.Decode(local_request(rid, prompt, **sampling), timeout=60)]

    expected_tokens = [SHORT_TOKENS] * len(short) + [LONG_TOKENS]

    async def run():
        server = await start(config, worker)
        try:
            async with aio_channel(server.address) as channel:
                stub = worker_pb2_grpc.DecodeWorkerStub(channel)
                shorts = [asyncio.ensure_future(stream(stub, f"s{i}", p, max_tokens=SHORT_TOKENS,
                                                       prompt_logprobs=1 if i == 0 else None))
                          for i, p in enumerate(short)]
                started = time.monotonic()
                while engine.runner.num_forward_tokens < 40:  # the short ones are decoding
                    assert time.monotonic() - started < 60, "the short streams never started decoding"
                    await asyncio.sleep(0.005)
                late = await stream(stub, "long", long)
                results = await asyncio.gather(*shorts)
                stats = await stub.Stats(worker_pb2.StatsRequest(), timeout=5)
                return results + [late], stats
        finally:
            await server.stop()

    results, stats = asyncio.run(run())
    for prompt, resps, n in zip(short + [long], results, expected_tokens):
        # The first response is the prefill answer alone; outputs follow.
        answer = resps[0].prefilled
        assert resps[0].HasField("prefilled") and not resps[0].token_ids and answer.prefill_seconds > 0
        assert not any(r.HasField("prefilled") for r in resps[1:])
        ids = [answer.first_token_id] + [t for r in resps[1:] for t in r.token_ids]
        assert_greedy_matches(hf, prompt, ids, n, what=f"{len(prompt)}-token prompt prefilled locally")
        assert resps[-1].finish_reason == pdserve_pb2.FINISH_REASON_LENGTH
    first = results[0][0].prefilled
    assert len(first.prompt_logprobs) == len(short[0]) - 1 == len(first.prompt_top_logprobs)
    assert not results[1][0].prefilled.prompt_logprobs
    # The long prompt ran in chunks of the budget left beside the short streams' decodes.
    mixed = [(rows, n) for rows, n in steps if rows and n]
    assert sum(n for _, n in mixed) == len(long) and all(rows + n <= 64 for rows, n in mixed)
    assert engine.runner.num_forward_tokens == sum(len(p) + n - 1 for p, n in zip(short + [long], expected_tokens))
    assert stats.num_blocks_used == 0 and stats.num_running == 0 and stats.kv_transfers == 0


def test_a_bad_local_request_is_invalid_argument_naming_the_field(tiny_llama_dir):
    config = decode_worker_config(worker_id="decode-local-bad")
    worker = DecodeWorker(config, engine=make_engine(tiny_llama_dir[0], policy=MIXED))

    async def run():
        server = await start(config, worker)
        try:
            async with aio_channel(server.address) as channel:
                stub = worker_pb2_grpc.DecodeWorkerStub(channel)
                try:
                    async for _ in stub.Decode(local_request("bad", [3, 100_000]), timeout=30):
                        pass
                except grpc.aio.AioRpcError as exc:
                    return exc, await stub.Stats(worker_pb2.StatsRequest(), timeout=5)
                raise AssertionError("a prompt token beyond the vocabulary was accepted")
        finally:
            await server.stop()

    error, stats = asyncio.run(run())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "prompt_token_ids: every id must be in [0, 512)"
    assert stats.num_blocks_used == 0
