"""``BlockManager.share_prefix``: a holder's pin on the cached full blocks of a prompt's prefix
(the reversed pull, pdserve/decode_worker/prefix_hold.py), and ``allocate(count=False)``, a
reader's pin for a prefix it reads (pdserve/prefill_worker/prefix_pull.py). Pure: no engine."""

import pytest

from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.errors import CacheCapacityError
from tests.factories import computed_blocks

BS = 4


def cached(tokens: list[int], num_blocks: int = 8) -> BlockManager:
    """A block manager whose prefix cache holds ``tokens`` (computed, then freed: CACHED)."""
    bm = BlockManager(num_blocks, BS)
    computed_blocks(bm, "turn-1", tokens)
    bm.free("turn-1")
    return bm


def test_it_pins_the_cached_full_blocks_before_the_last_tokens_block_and_nothing_fresh():
    bm = cached(list(range(13)))  # 3 full blocks cached
    prompt = list(range(13)) + [99, 98]  # 15 tokens: blocks 0-2 cached, block 3 holds the last token
    queries, hits = bm.prefix_queries, bm.prefix_hits
    alloc = bm.share_prefix("pin", prompt)
    assert alloc.num_cached_tokens == 3 * BS and len(alloc.block_ids) == 3
    assert not set(alloc.block_ids) & set(bm._free)  # referenced: neither evicted nor reused
    assert (bm.prefix_queries, bm.prefix_hits) == (queries, hits)  # a pin is no prefix query
    bm.check_invariants()
    bm.free("pin")
    assert bm.num_free_blocks == 8 and bm.share_prefix("again", prompt).block_ids == alloc.block_ids
    bm.check_invariants()


def test_the_block_of_the_prompts_last_token_is_never_pinned():
    bm = cached(list(range(13)))
    assert len(bm.share_prefix("pin", list(range(12))).block_ids) == 2  # 12 tokens: block 2 holds the last


def test_nothing_cached_or_another_salt_pins_nothing_and_registers_no_sequence():
    bm = cached(list(range(13)))
    assert bm.share_prefix("pin", [7] * 13).block_ids == ()
    assert bm.share_prefix("salted", list(range(13)), cache_salt="tenant-b").block_ids == ()
    assert not bm.has("pin") and not bm.has("salted")
    bm.check_invariants()


def test_a_pinned_block_outlives_a_prompt_that_needs_every_block():
    bm = cached(list(range(13)))
    bm.share_prefix("pin", list(range(13)))
    with pytest.raises(CacheCapacityError):
        bm.allocate("big", list(range(100, 100 + 8 * BS)))
    bm.free("pin")
    bm.allocate("big", list(range(100, 100 + 8 * BS)))  # now it evicts them
    assert bm.share_prefix("gone", list(range(13))).block_ids == ()
    bm.check_invariants()


def test_an_uncounted_allocation_counts_no_query_and_finds_the_same_hits():
    bm = cached(list(range(13)))
    queries, hits = bm.prefix_queries, bm.prefix_hits
    alloc = bm.allocate("pin", list(range(13)), count=False)
    assert alloc.num_cached_tokens == 3 * BS and (bm.prefix_queries, bm.prefix_hits) == (queries, hits)
    bm.check_invariants()
