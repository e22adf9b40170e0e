"""DeepSeek (MLA) disaggregated: a real prefill worker and a real decode worker (a small
random V3-shaped model, float32) behind their real gRPC servers in this process, the KV moved
over NIXL and over tcp. The decode worker's tokens equal transformers' greedy ones, and what
moved is the latent: one row of kv_lora_rank + qk_rope_head_dim values per prompt token and
layer, not per-head K/V."""

import asyncio
import contextlib

import pytest

from pdserve.decode_worker.server import start as start_decode
from pdserve.decode_worker.worker import DecodeWorker
from pdserve.prefill_worker.server import start as start_prefill
from pdserve.prefill_worker.worker import PrefillWorker
from pdserve.protos import pdserve_pb2, worker_pb2, worker_pb2_grpc
from pdserve.wire.grpc_util import aio_channel
from tests.deepseek_models import MLA_SHAPE, make_deepseek
from tests.factories import (assert_greedy_matches, decode_worker_config, make_engine, prefill_worker_config,
                             random_prompts, save_hf_model)
from tests.helpers.kv_layout import moved_bytes

pytestmark = pytest.mark.slow

MAX_TOKENS = 12
SAMPLING = pdserve_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    hf = make_deepseek("v3")
    return save_hf_model(hf, tmp_path_factory.mktemp("deepseek-v3")), hf


@contextlib.asynccontextmanager
async def pair(model_dir, backend: str):
    prefill = PrefillWorker(prefill_worker_config(kv_transfer_backend=backend), engine=make_engine(model_dir))
    decode = DecodeWorker(decode_worker_config(kv_transfer_backend=backend), engine=make_engine(model_dir))
    servers = [await start_prefill(prefill.config, prefill), await start_decode(decode.config, decode)]
    channels = [aio_channel(s.address) for s in servers]
    try:
        yield decode, worker_pb2_grpc.PrefillWorkerStub(channels[0]), worker_pb2_grpc.DecodeWorkerStub(channels[1])
    finally:
        for c in channels:
            await c.close()
        for s in servers:
            await s.stop()


async def generate(p_stub, d_stub, rid: str, prompt: list[int]) -> list[int]:
    """The prefill worker's first token, then the decode worker's stream from the pulled KV."""
    pre = await p_stub.Prefill(worker_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling=SAMPLING),
                               timeout=60)
    request = worker_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt, first_token_id=pre.first_token_id,
                                       sampling=SAMPLING, kv=pre.kv)
    tokens = [pre.first_token_id]
    async for resp in d_stub.Decode(request, timeout=60):
        tokens += resp.token_ids
    return tokens


@pytest.mark.parametrize("backend", ["nixl", "tcp"])
def test_decode_worker_tokens_equal_transformers_and_the_latent_is_what_moves(v3, backend):
    directory, hf = v3
    prompts = random_prompts(3, [5, 40, 100], seed=21)

    async def run():
        async with pair(directory, backend) as (decode, p_stub, d_stub):
            outs = [await generate(p_stub, d_stub, f"r{i}", p) for i, p in enumerate(prompts)]
            return outs, await d_stub.Stats(worker_pb2.StatsRequest(), timeout=5), decode.engine.runner

    outs, stats, runner = asyncio.run(run())
    for prompt, tokens in zip(prompts, outs):
        assert_greedy_matches(hf, prompt, tokens, MAX_TOKENS, what=f"{backend}, a {len(prompt)}-token prompt")
    latent_row = MLA_SHAPE["kv_lora_rank"] + MLA_SHAPE["qk_rope_head_dim"]
    assert stats.kv_bytes_per_token == MLA_SHAPE["num_hidden_layers"] * latent_row * 4  # float32
    assert stats.kv_transfers == len(prompts)
    assert stats.kv_transfer_bytes == sum(moved_bytes(len(p), 0, stats.kv_bytes_per_token) for p in prompts)
    assert runner.num_forward_tokens == len(prompts) * (MAX_TOKENS - 1)  # no prompt recomputed
