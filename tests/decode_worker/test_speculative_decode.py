"""Speculative decoding on the decode side of a disaggregated pair (issue 57): a real prefill
worker and two real decode workers behind their gRPC servers, the KV read over NIXL, the
router's request run; the decode worker that speculates (n-gram) streams the same greedy tokens
as the one that does not, several tokens in one response where guesses were kept, and every
block of all three is free at the end."""

import asyncio

import pytest

from pdserve.decode_worker.worker import DecodeWorker
from pdserve.engine.config import MIXED, SpeculativeConfig
from pdserve.prefill_worker.worker import PrefillWorker
from tests.factories import decode_worker_config, hf_greedy, make_engine, prefill_worker_config, random_prompts
from tests.helpers.worker_servers import generate, pool_per_decoder, serving, settle

NGRAM = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3)


@pytest.mark.slow
def test_a_speculating_decode_worker_streams_the_tokens_of_one_that_does_not(tiny_llama_dir):
    directory, hf = tiny_llama_dir
    phrase, other = random_prompts(2, [9, 30], seed=21)
    prompts = [phrase * 4, other]

    def decode_worker(speculative) -> DecodeWorker:
        return DecodeWorker(decode_worker_config(worker_id=f"decode-{bool(speculative)}", kv_transfer_backend="nixl"),
                            engine=make_engine(directory, num_blocks=64, policy=MIXED, speculative=speculative))

    prefill = PrefillWorker(prefill_worker_config(kv_transfer_backend="nixl"), engine=make_engine(directory, num_blocks=64))
    speculating, plain = decode_worker(NGRAM), decode_worker(None)

    async def main():
        async with serving(prefill, [speculating, plain]) as pool:
            pools = pool_per_decoder(pool)
            out = [[await generate(pools[i], f"r{i}-{j}", p, 24) for j, p in enumerate(prompts)] for i in (0, 1)]
            await settle(prefill, [speculating, plain])
            return out

    (spec_out, plain_out) = asyncio.run(main())
    assert spec_out == plain_out
    assert spec_out == [hf_greedy(hf, p, 24) for p in prompts]
    stats = speculating.engine.spec_stats
    assert stats.num_accepted_tokens > 0 and plain.engine.spec_stats is None
    speculating.engine.blocks.check_invariants()
