"""The reversed pull on the check's device (pdserve/prefill_worker/prefix_pull.py): a decode
worker's cache on the device holds a conversation's first turn; a prefill worker on the same
device reads that prefix from it over NIXL (VRAM to VRAM), checked against the checksums the
holder took of its device blocks, computes only the new message, and the decode worker reads
the answer's KV back and decodes. float32 against transformers on the device; every lease
ends and every block is free after. tests/prefill_worker/test_prefix_pull.py runs the same on
the CPU with the real default model, and its fallbacks."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch

from pdserve.decode_worker.worker import DecodeWorker
from pdserve.kv_transfer.handoff import ReleaseReason, release_request
from pdserve.prefill_worker.worker import PrefillWorker
from pdserve.protos import worker_pb2
from tests.factories import decode_worker_config, make_engine, prefill_worker_config
from tests.gpu.smol import reference
from tests.helpers.device_checks import assert_device_greedy
from tests.helpers.prefix_pull import (ANSWER, BLOCK, MAX_TOKENS, NUM_BLOCKS, first_turn, second_turn, settled,
                                       still_held)
from tests.helpers.worker_servers import serving

pytestmark = pytest.mark.cuda


@contextlib.asynccontextmanager
async def device_pair(smol_dir, device: torch.device):
    engine = dict(num_blocks=NUM_BLOCKS, block_size=BLOCK, device=device.type)
    prefill = PrefillWorker(prefill_worker_config(kv_transfer_backend="nixl"), engine=make_engine(smol_dir, **engine))
    decoder = DecodeWorker(decode_worker_config(kv_transfer_backend="nixl"), engine=make_engine(smol_dir, **engine))
    async with serving(prefill, [decoder]) as pool:
        stubs = {c.role: c.stub for c in pool.workers.values()}
        yield prefill, decoder, stubs["prefill"], stubs["decode"]


def test_a_prefix_read_from_a_decode_worker_on_the_device_equals_transformers(smol_dir, device):
    first = list(range(3, 3 + 5 * BLOCK + 7))  # byte ids: 87 tokens, the answer's 24 more
    second = [40, 41, 42, 43, 44, 45]

    async def main():
        async with device_pair(smol_dir, device) as (prefill, decoder, p_stub, d_stub):
            answer1 = await first_turn(d_stub, first)
            prompt = first + answer1 + second
            held = await d_stub.HoldPrefix(worker_pb2.HoldPrefixRequest(request_id="turn-2", prompt_token_ids=prompt,
                                                                        router_id="router-a"), timeout=30)
            answer, tokens = await second_turn(p_stub, d_stub, prompt, held.kv)
            stats = await p_stub.Stats(worker_pb2.StatsRequest(), timeout=5)
            holding = await still_held(decoder)
            await d_stub.Release(release_request(held.kv.lease_token, ReleaseReason.ABORTED), timeout=5)
            return prompt, held.kv, answer, tokens, stats, holding, await settled(prefill, decoder)

    prompt, held, answer, tokens, stats, holding, (leases, p_free, d_free) = asyncio.run(main())
    assert held.num_tokens == (len(first) + ANSWER - 1) // BLOCK * BLOCK
    assert answer.num_cached_tokens == held.num_tokens and stats.prefix_tokens_read == held.num_tokens
    assert stats.kv_transfer_failures == 0 and stats.kv_verify_failures == 0
    assert len(tokens) == MAX_TOKENS
    assert_device_greedy(reference(smol_dir, torch.float32, device), prompt, tokens, "reversed pull on the device")
    assert holding == 0 and leases == 0 and p_free == NUM_BLOCKS and d_free == NUM_BLOCKS
