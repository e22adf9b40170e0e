"""Block accounting, prefix hashing and reuse: the block manager alone, no torch."""

import random

import pytest

from pdserve.engine.core.block_manager import NO_HASH, BlockManager, chain_hash
from pdserve.engine.errors import CacheCapacityError
from tests.factories import computed_blocks



def test_allocate_and_free_returns_every_block():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_cache=False)
    a = bm.allocate("a", list(range(9)))  # 9 tokens -> 3 blocks
    assert len(a.block_ids) == 3 and a.num_cached_tokens == 0
    assert bm.num_free_blocks == 7
    bm.free("a")
    assert bm.num_free_blocks == 10


def test_append_slots_grows_only_at_block_boundaries():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_cache=False)
    toks = list(range(4))
    bm.allocate("a", toks)
    assert len(bm.block_table("a")) == 1
    toks.append(4)
    assert bm.append_slots("a", toks)
    assert len(bm.block_table("a")) == 2
    toks.extend([5, 6, 7])
    assert bm.append_slots("a", toks)
    assert len(bm.block_table("a")) == 2


def test_append_slots_reports_exhaustion_without_changing_state():
    bm = BlockManager(num_blocks=2, block_size=2, enable_prefix_cache=False)
    bm.allocate("a", [1, 2, 3])
    table = list(bm.block_table("a"))
    assert not bm.append_slots("a", [1, 2, 3, 4, 5])
    assert bm.block_table("a") == table and bm.num_free_blocks == 0


def test_allocation_beyond_capacity_raises_with_numbers():
    bm = BlockManager(num_blocks=2, block_size=4)
    with pytest.raises(CacheCapacityError) as err:
        bm.check_fits(9)
    assert err.value.needed_blocks == 3 and err.value.total_blocks == 2


def test_chain_hash_depends_on_prefix_and_is_stable():
    h1 = chain_hash(NO_HASH, [1, 2, 3])
    assert h1 == chain_hash(NO_HASH, [1, 2, 3])
    assert chain_hash(h1, [4, 5, 6]) != chain_hash(NO_HASH, [4, 5, 6])


def test_prefix_cache_reuses_full_blocks_of_a_shared_prompt():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    a = computed_blocks(bm, "a", prompt)
    b = bm.allocate("b", prompt[:8] + [7, 7, 7])
    assert b.num_cached_tokens == 8
    assert b.block_ids[:2] == a.block_ids[:2]
    assert b.block_ids[2] != a.block_ids[2]
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 16


def test_fully_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(8))  # exactly 2 blocks
    computed_blocks(bm, "a", prompt)
    bm.free("a")
    again = bm.allocate("b", prompt)
    assert again.num_cached_tokens == 4  # the last block is recomputed, never shared-and-written


def test_freed_blocks_keep_their_hash_until_reused():
    bm = BlockManager(num_blocks=3, block_size=2)
    computed_blocks(bm, "a", [1, 2, 3, 4, 5])
    bm.free("a")
    assert bm.allocate("b", [1, 2, 3, 4, 9]).num_cached_tokens == 4
    bm.free("b")
    bm.allocate("c", [7, 7, 7, 7, 7, 7])  # takes every block, evicting the cached ones
    bm.free("c")
    assert bm.allocate("d", [1, 2, 3, 4, 9]).num_cached_tokens == 0


def test_hit_and_query_counters():
    bm = BlockManager(num_blocks=8, block_size=2)
    computed_blocks(bm, "a", [1, 2, 3, 4, 5])
    bm.allocate("b", [1, 2, 3, 4, 6])
    assert bm.prefix_queries == 8 and bm.prefix_hits == 4  # tokens: 4 blocks looked up, 2 found


def test_blocks_are_findable_only_once_final():
    """An allocated block is not findable until ``mark_final``: a second request with the
    same prompt, allocated while the first is still computing, shares only what is final."""
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(100, 113))  # 3 full blocks + 1 token
    bm.allocate("a", prompt)
    assert bm.allocate("b", prompt).num_cached_tokens == 0  # nothing of "a" is computed yet
    bm.mark_final("a", prompt, 6)  # a first chunk of 6 tokens: one full block
    assert bm.allocate("c", prompt).num_cached_tokens == 4
    bm.free("a")
    assert bm.allocate("d", prompt).num_cached_tokens == 4  # the rest was never final
    bm.check_invariants()


def test_an_abandoned_allocation_leaves_nothing_findable():
    """A prompt aborted before its step, or a pull that failed, frees PENDING blocks: no hash,
    no published event."""
    bm = BlockManager(num_blocks=8, block_size=2)
    events = []
    bm.subscribe(lambda h, cached: events.append(cached))
    bm.allocate("a", [1, 2, 3, 4, 5])
    bm.free("a")
    assert events == [] and bm.cached_hashes() == []
    assert bm.allocate("b", [1, 2, 3, 4, 5]).num_cached_tokens == 0


def test_mark_final_beyond_the_blocks_held_is_refused():
    from pdserve.engine.core.block_manager import BlockStateError

    bm = BlockManager(num_blocks=8, block_size=2)
    bm.allocate("a", [1, 2, 3])
    with pytest.raises(BlockStateError):
        bm.mark_final("a", [1, 2, 3, 4, 5], 5)


def test_mark_final_hashes_blocks_filled_during_decode():
    bm = BlockManager(num_blocks=8, block_size=2)
    toks = [1, 2, 3]
    computed_blocks(bm, "a", toks)
    toks.append(4)
    bm.append_slots("a", toks)
    bm.mark_final("a", toks, 4)
    bm.free("a")
    assert bm.allocate("b", [1, 2, 3, 4, 5]).num_cached_tokens == 4


@pytest.mark.parametrize("seed", range(5))
def test_random_workload_never_leaks_or_double_frees(seed):
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=32, block_size=4)
    live: dict[str, list[int]] = {}
    for step in range(400):
        op = rng.random()
        if op < 0.4 and len(live) < 8:
            sid = f"s{step}"
            toks = [rng.randrange(4) for _ in range(rng.randrange(1, 20))]
            if bm.can_allocate(len(toks)):
                computed_blocks(bm, sid, toks)
                live[sid] = toks
        elif op < 0.8 and live:
            sid = rng.choice(list(live))
            live[sid].append(rng.randrange(4))
            if bm.append_slots(sid, live[sid]):
                bm.mark_final(sid, live[sid], len(live[sid]) - 1)
            else:
                live[sid].pop()
        elif live:
            sid = rng.choice(list(live))
            del live[sid]
            bm.free(sid)
        referenced = {b for sid in live for b in bm.block_table(sid)}
        assert len(referenced) + bm.num_free_blocks == 32
        bm.check_invariants()
    for sid in list(live):
        bm.free(sid)
    assert bm.num_free_blocks == 32


def test_quarantined_blocks_are_never_handed_out_and_come_back_only_by_release():
    """A pull aborted while its read may still write blocks 1 and 2 of its three: those are
    neither held nor free until the transport says the read is over."""
    from pdserve.engine.core.block_manager import BlockStateError

    bm = BlockManager(num_blocks=4, block_size=2)
    ids = bm.allocate("pull", [1, 2, 3, 4, 5], use_prefix_cache=False).block_ids
    bm.free("pull", quarantine=ids[1:])
    assert (bm.num_free_blocks, bm.num_quarantined, bm.usage) == (2, 2, 0.5)
    assert not set(bm.allocate("next", [7, 8, 9, 10]).block_ids) & set(ids[1:])
    with pytest.raises(CacheCapacityError):
        bm.allocate("one-more", [6])
    with pytest.raises(BlockStateError):
        bm.release_quarantined([ids[0]])  # never quarantined
    bm.check_invariants()
    bm.release_quarantined(ids[1:])
    assert (bm.num_free_blocks, bm.num_quarantined) == (2, 0)
    with pytest.raises(BlockStateError):
        bm.release_quarantined(ids[1:])  # once only
    assert set(bm.allocate("after", [6, 6, 6]).block_ids) == set(ids[1:])
    bm.check_invariants()


def test_only_blocks_a_sequence_holds_alone_can_be_quarantined():
    from pdserve.engine.core.block_manager import BlockStateError

    bm = BlockManager(num_blocks=8, block_size=2)
    computed_blocks(bm, "a", [1, 2, 3, 4, 5])
    shared = bm.allocate("b", [1, 2, 3, 4, 5, 6]).block_ids
    with pytest.raises(BlockStateError):
        bm.free("b", quarantine=[shared[0]])  # a's too: a late write would land in a's KV
    with pytest.raises(BlockStateError):
        bm.free("gone", quarantine=[7])
    assert bm.block_table("b") == list(shared) and bm.num_quarantined == 0  # nothing changed
    bm.free("b", quarantine=[shared[-1]])
    assert bm.num_quarantined == 1 and bm.num_free_blocks == 8 - 3 - 1  # a holds 3, one is quarantined
    bm.check_invariants()
