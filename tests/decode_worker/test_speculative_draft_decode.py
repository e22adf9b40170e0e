"""A draft model on the decode side of a disaggregated pair (issue 57): a real prefill worker and
a real decode worker behind their gRPC servers, the target's KV read over NIXL, the router's
request run. The decode worker builds the draft's KV from the transferred prompt's tokens (the
prefill pool never runs the draft), streams transformers' greedy tokens of the target (float32),
and every block of the target's caches and of the draft's is free at the end."""

import asyncio

from pdserve.decode_worker.worker import DecodeWorker
from pdserve.engine.config import MIXED, SpeculativeConfig
from pdserve.prefill_worker.worker import PrefillWorker
from tests.factories import decode_worker_config, hf_greedy, make_engine, prefill_worker_config, random_prompts
from tests.helpers.worker_servers import generate, serving, settle

MAX_TOKENS = 16


def test_a_decode_worker_with_a_draft_model_streams_the_targets_greedy_tokens(tiny_llama_dir, tiny_draft_dir):
    directory, hf = tiny_llama_dir
    spec = SpeculativeConfig(method="draft_model", model=str(tiny_draft_dir), num_speculative_tokens=3)
    prefill = PrefillWorker(prefill_worker_config(kv_transfer_backend="nixl"), engine=make_engine(directory, num_blocks=64))
    decode = DecodeWorker(decode_worker_config(kv_transfer_backend="nixl"),
                          engine=make_engine(directory, num_blocks=64, policy=MIXED, speculative=spec))
    prompts = random_prompts(2, [6, 37], seed=31)

    async def main():
        async with serving(prefill, [decode]) as pool:
            out = [await generate(pool, f"r{i}", p, MAX_TOKENS) for i, p in enumerate(prompts)]
            await settle(prefill, [decode])
            return out

    outs = asyncio.run(main())
    assert outs == [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    stats = decode.engine.spec_stats
    assert stats.num_drafts > 0
    draft = decode.engine.spec.proposer
    # The draft ran every prompt token itself (its catch-up), then its guesses.
    assert draft.runner.num_forward_tokens >= sum(map(len, prompts)) + stats.num_draft_tokens
    assert draft.num_tracked == 0 and draft.blocks.num_free_blocks == draft.blocks.num_blocks
    decode.engine.blocks.check_invariants()
