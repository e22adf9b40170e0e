"""Tensor parallelism on the check's device (pdserve/engine/distributed/, docs/gpu.md "Tensor
parallelism on GPUs"): a worker of two ranks, each rank's weights and KV cache on the device,
each rank's KV-transfer agent created in its own process over its own device memory
(pdserve/kv_transfer/remote_agent.py). The check's host has one GPU, so both ranks share it:
rank r runs on device r modulo the devices, and the ranks talk over gloo on CUDA tensors where
NCCL would need a device each. A model of SmolLM2's width with 4 KV heads (SmolLM2's 3 do not
split in two), in float32.

What must hold: two ranks give the tokens of one, and transformers'; KV moves by head from a
TP 2 prefill worker to a TP 1 decode worker (NIXL, VRAM to VRAM), and a conversation's prefix
held by the TP 1 decode worker is read back by head by the TP 2 prefill worker, with the same
tokens. tests/decode_worker/test_cross_tp.py and tests/prefill_worker/test_prefix_pull.py run the
same code on the CPU. ``PDSERVE_CHECK_DEVICE=cpu`` runs this file there too (proving the test,
not CUDA)."""

from __future__ import annotations

import asyncio
import contextlib
import os

import pytest
import torch

from pdserve.decode_worker.worker import DecodeWorker
from pdserve.engine.sampling.params import SamplingParams
from pdserve.kv_transfer.handoff import ReleaseReason, release_request
from pdserve.prefill_worker.worker import PrefillWorker
from pdserve.protos import worker_pb2
from tests.factories import decode_worker_config, make_engine, make_tp_engine, prefill_worker_config
from tests.gpu.smol import SMOLLM2_135M, INIT_STD, byte_tokenizer, reference
from tests.helpers.device_checks import assert_device_greedy
from tests.helpers.prefix_pull import BLOCK, MAX_TOKENS, NUM_BLOCKS, first_turn, second_turn, settled
from tests.helpers.worker_servers import serving

pytestmark = pytest.mark.cuda

PROMPTS = [[3 + (7 * i + 13 * n) % 256 for i in range(n)] for n in (5, 37, 70)]  # byte ids
SHAPE = dict(num_attention_heads=8, num_key_value_heads=4, hidden_size=512,
             num_hidden_layers=min(4, int(os.environ.get("PDSERVE_CHECK_LAYERS", 4))))  # the dry run shortens it


@pytest.fixture(scope="module")
def tp_dir(tmp_path_factory, device):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", **{**SMOLLM2_135M, **SHAPE}, initializer_range=INIT_STD)
    directory = tmp_path_factory.mktemp("smol-tp")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(directory))
    byte_tokenizer().save_pretrained(str(directory))
    return directory


def engine(directory, device: torch.device, tp: int):
    kwargs = dict(num_blocks=NUM_BLOCKS, block_size=BLOCK, device=device.type)
    return make_engine(directory, **kwargs) if tp == 1 else make_tp_engine(directory, tp, **kwargs)


def test_two_ranks_on_the_device_give_the_tokens_of_one_and_transformers(tp_dir, device):
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    tp1 = [c.token_ids for c in engine(tp_dir, device, 1).generate(PROMPTS, params)]
    tp2_engine = engine(tp_dir, device, 2)
    try:
        assert tp2_engine.kv_cache.device.type == device.type and tp2_engine.tensor_parallel_size == 2
        tp2 = [c.token_ids for c in tp2_engine.generate(PROMPTS, params)]
    finally:
        tp2_engine.close()
    assert tp2 == tp1
    hf = reference(tp_dir, torch.float32, device)
    for prompt, ours in zip(PROMPTS, tp2):
        assert_device_greedy(hf, prompt, ours, "tp 2 on the device")


def test_two_ranks_sharing_the_device_size_their_cache_by_a_share(tp_dir, device):
    """``--gpu-memory-utilization`` at TP 2 (pdserve/engine/distributed/memory_share.py): both
    ranks profile their use once loaded; on one GPU they share its memory, so the cache is what
    0.2 of it leaves after both ranks' peaks, split between them; the tokens are TP 1's."""
    if device.type != "cuda":
        pytest.skip("a share of host RAM is gigabytes: tests/engine/test_kv_sizing.py runs TP 2 with a share on the CPU")
    from pdserve.engine.config import CacheConfig, EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.shell.rank_follower import RANK_ENTRY

    share = 0.2
    total = torch.cuda.mem_get_info(device)[1]
    config = EngineConfig(model=str(tp_dir), dtype="float32", device="cuda", tensor_parallel_size=2,
                          cache=CacheConfig(block_size=BLOCK, gpu_memory_utilization=share))
    tp2 = LLMEngine.from_config(config, progress=False, detokenize=False, on_rank_lost=lambda exc: None,
                                follower_entry=RANK_ENTRY)
    try:
        size = tp2.cache_size
        assert "for 2 ranks together" in size.source and tp2.kv_cache.shape[0] == size.num_blocks
        assert 0 < 2 * size.num_blocks * size.block_bytes < share * total
        print(f"\nTP 2 at {share} of {total / 2**30:.1f} GiB: {size.line()}")
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        ours = [c.token_ids for c in tp2.generate(PROMPTS, params)]
    finally:
        tp2.close()
    assert ours == [c.token_ids for c in engine(tp_dir, device, 1).generate(PROMPTS, params)]


@contextlib.asynccontextmanager
async def tp_pair(directory, device: torch.device):
    """A TP 2 prefill worker and a TP 1 decode worker on the device, over NIXL, with stubs."""
    prefill = PrefillWorker(prefill_worker_config(kv_transfer_backend="nixl", reader_tp=1),
                            engine=engine(directory, device, 2))
    decoder = DecodeWorker(decode_worker_config(kv_transfer_backend="nixl", reader_tp=2),
                           engine=engine(directory, device, 1))
    try:
        async with serving(prefill, [decoder]) as pool:
            stubs = {c.role: c.stub for c in pool.workers.values()}
            yield prefill, decoder, stubs["prefill"], stubs["decode"]
    finally:
        prefill.engine.close()


def test_kv_and_a_held_prefix_move_by_head_between_tp2_and_tp1_workers_on_the_device(tp_dir, device):
    fresh = PROMPTS[2]
    first = list(range(3, 3 + 5 * BLOCK + 7))  # 87 byte ids: 5 full blocks and more
    second = [40, 41, 42, 43, 44, 45]

    async def main():
        async with tp_pair(tp_dir, device) as (prefill, decoder, p_stub, d_stub):
            # The prompt prefilled on both prefill ranks; the decode worker reads each rank's heads.
            _, fresh_tokens = await second_turn(p_stub, d_stub, fresh, None)
            decode_reads = decoder.agent.stats.snapshot().transfers
            answer1 = await first_turn(d_stub, first)
            prompt = first + answer1 + second
            held = await d_stub.HoldPrefix(worker_pb2.HoldPrefixRequest(request_id="turn-2", prompt_token_ids=prompt,
                                                                        router_id="router-a"), timeout=30)
            answer, tokens = await second_turn(p_stub, d_stub, prompt, held.kv)
            stats = await p_stub.Stats(worker_pb2.StatsRequest(), timeout=5)
            await d_stub.Release(release_request(held.kv.lease_token, ReleaseReason.ABORTED), timeout=5)
            return fresh_tokens, decode_reads, prompt, held.kv, answer, tokens, stats, await settled(prefill, decoder)

    fresh_tokens, decode_reads, prompt, held, answer, tokens, stats, (leases, p_free, d_free) = asyncio.run(main())
    hf = reference(tp_dir, torch.float32, device)
    assert decode_reads >= 2  # a read from each prefill rank
    assert_device_greedy(hf, fresh, fresh_tokens, "kv by head, tp 2 -> tp 1, on the device")
    assert held.num_tokens >= 4 * BLOCK and answer.num_cached_tokens == held.num_tokens  # the prefix was read
    assert stats.prefix_tokens_read == held.num_tokens
    assert stats.kv_transfer_failures == 0 and stats.kv_verify_failures == 0
    assert_device_greedy(hf, prompt, tokens, "a held prefix read by head, tp 1 -> tp 2, on the device")
    assert leases == 0 and p_free == NUM_BLOCKS and d_free == NUM_BLOCKS
