"""A decode worker holds a prompt's cached prefix for a prefill worker's read (the reversed
pull, ``pdserve.decode_worker.prefix_hold``): real worker and engine (tiny model, float32),
its engine thread running; the read itself, and the notice that ends the lease, are
tests/prefill_worker/test_prefix_pull.py's.

What a holder promises: the held blocks are exactly the cached full blocks of the prompt's
prefix (never the block of its last token), they stay referenced while the lease lives (not
free, so neither evicted nor reused), and whichever way the lease ends (release, expiry) the
pin goes and the blocks are the prefix cache's again, findable and evictable: nothing is
stranded, and the block manager's invariants hold throughout."""

import asyncio
import contextlib

import pytest

from pdserve.decode_worker.worker import DecodeWorker
from pdserve.engine.core.block_manager import prompt_block_hashes
from pdserve.engine.errors import CacheCapacityError
from pdserve.engine.sampling.params import SamplingParams
from pdserve.kv_transfer.handoff import LeaseRefused, ReleaseReason
from tests.factories import decode_worker_config, make_engine, random_prompts

BLOCK, NUM_BLOCKS, ANSWER = 16, 32, 20


@contextlib.asynccontextmanager
async def running(tiny_llama_dir, **config):
    directory, _ = tiny_llama_dir
    worker = DecodeWorker(decode_worker_config(kv_transfer_backend="tcp", **config),
                          engine=make_engine(directory, num_blocks=NUM_BLOCKS, block_size=BLOCK))
    worker.start()
    try:
        yield worker
    finally:
        worker.stop()


async def turn(worker: DecodeWorker, rid: str, prompt: list[int]) -> list[int]:
    """One turn prefilled and decoded here: its answer (its blocks stay cached after)."""
    params = SamplingParams(max_tokens=ANSWER, temperature=0.0, ignore_eos=True)
    out = [t async for item in worker.prefill_and_decode(rid, prompt, params) for t in getattr(item, "new_token_ids", [])]
    return out


def free_ids(worker: DecodeWorker) -> set[int]:
    return set(worker.engine.blocks._free)


def test_a_hold_pins_the_cached_prefix_until_released_and_strands_nothing(tiny_llama_dir):
    prompt = random_prompts(1, [50], seed=3)[0]

    async def main():
        async with running(tiny_llama_dir) as worker:
            blocks, holds = worker.engine.blocks, worker.prefix_holds
            answer = await turn(worker, "turn-1", prompt)
            follow_up = prompt + answer + [7, 8, 9]
            nothing = await worker.call(holds.hold, "d:1", [5] * 40, "", "router-a")
            other_salt = await worker.call(holds.hold, "d:1", follow_up, "tenant-b", "router-a")
            free_before = blocks.num_free_blocks
            kv = await worker.call(holds.hold, "d:1", follow_up, "", "router-a")
            pinned = set(kv.block_ids)
            held_free = free_ids(worker) & pinned
            held_free_count = blocks.num_free_blocks
            await worker.call(blocks.check_invariants)
            released = await worker.call(holds.release, kv.lease_token, ReleaseReason.ABORTED)
            again = await worker.call(holds.release, kv.lease_token, ReleaseReason.ABORTED)
            await worker.call(blocks.check_invariants)
            return (nothing, other_salt, kv, pinned, held_free, free_before, held_free_count, released, again,
                    blocks.num_free_blocks, free_ids(worker) & pinned, len(holds), follow_up)

    (nothing, other_salt, kv, pinned, held_free, free_before, held_free_count, released, again, free_after,
     free_pinned_after, leases_left, follow_up) = asyncio.run(main())
    assert nothing is None and other_salt is None  # nothing cached under that prompt, or that salt
    # Turn 1's prompt and answer, less the last sampled token (never computed): 69 tokens, 4 full
    # blocks; the follow-up's prefix of full blocks before its last token's block is those 4.
    assert len(kv.block_ids) == 4 and kv.num_tokens == 4 * BLOCK
    assert len(prompt_block_hashes(follow_up, BLOCK)) >= 4
    assert kv.lease_token and len(kv.block_checksums) == 4 and kv.prefill_address == "d:1"
    assert not held_free and held_free_count == free_before - 4  # referenced while held: not free
    assert released and not again and leases_left == 0
    assert free_after == NUM_BLOCKS and free_pinned_after == pinned  # every pinned block free again


def test_a_hold_ends_at_expiry_and_a_claim_after_it_is_refused(tiny_llama_dir):
    prompt = random_prompts(1, [40], seed=4)[0]

    async def main():
        async with running(tiny_llama_dir, lease_seconds=0.3) as worker:
            holds = worker.prefix_holds
            answer = await turn(worker, "turn-1", prompt)
            kv = await worker.call(holds.hold, "d:1", prompt + answer + [1], "", "")
            held = worker.engine.blocks.num_free_blocks
            for _ in range(100):
                if not len(holds):
                    break
                await asyncio.sleep(0.02)
            with pytest.raises(LeaseRefused) as refused:
                holds.claim(kv.lease_token, list(kv.block_ids))
            await worker.call(worker.engine.blocks.check_invariants)
            # The blocks are the prefix cache's again: a new hold finds them.
            again = await worker.call(holds.hold, "d:1", prompt + answer + [1], "", "")
            return kv, held, len(holds), refused.value.reason, again, worker.engine.blocks.num_free_blocks

    kv, held, left, reason, again, free_at_end = asyncio.run(main())
    assert kv is not None and held == NUM_BLOCKS - len(kv.block_ids)
    assert left == 1 and reason == "unknown_token"  # (the second hold's lease is the one left)
    assert again.block_ids == kv.block_ids and again.lease_token != kv.lease_token
    assert free_at_end == NUM_BLOCKS - len(kv.block_ids)


def test_a_held_prefix_is_not_evicted_by_a_prompt_that_needs_its_blocks(tiny_llama_dir):
    """A prompt needing more blocks than are free while the prefix is held waits (the pin
    wins); after the release it runs, and the prefix is evicted only then."""
    prompt = random_prompts(1, [40], seed=5)[0]

    async def main():
        async with running(tiny_llama_dir) as worker:
            blocks, holds = worker.engine.blocks, worker.prefix_holds
            answer = await turn(worker, "turn-1", prompt)
            kv = await worker.call(holds.hold, "d:1", prompt + answer + [1], "", "")
            big = random_prompts(1, [NUM_BLOCKS * BLOCK], seed=6)[0]  # every block
            with pytest.raises(CacheCapacityError):  # does not fit beside the pin: refused, the pin stays
                await worker.call(blocks.allocate, "big", big)
            still = await worker.call(holds.hold, "d:1", prompt + answer + [1], "", "")
            await worker.call(holds.release, still.lease_token, ReleaseReason.ABORTED)
            await worker.call(holds.release, kv.lease_token, ReleaseReason.ABORTED)
            await worker.call(blocks.allocate, "big", big)
            gone = await worker.call(holds.hold, "d:1", prompt + answer + [1], "", "")
            await worker.call(blocks.free, "big")
            await worker.call(blocks.check_invariants)
            return kv, still, gone, blocks.num_free_blocks

    kv, still, gone, free_at_end = asyncio.run(main())
    assert still.block_ids == kv.block_ids  # the held blocks were not handed out
    assert gone is None and free_at_end == NUM_BLOCKS  # after the release they could be
