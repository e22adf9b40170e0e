"""Tails (pdserve/engine/core/block_tails.py): the last, partial block of a freed sequence is taken,
zero-copy, by the next prompt that extends it, so a conversation's next turn does not compute
the previous answer's last partial block again (issue 44). The block manager alone, no torch."""

import pytest

from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.core.block_tails import MAX_TAILS_PER_PARENT
from pdserve.engine.config import SchedulerConfig
from pdserve.engine.sampling.params import SamplingParams
from pdserve.engine.core.scheduler import Scheduler
from pdserve.engine.core.sequence import Sequence
from tests.factories import computed_blocks

BS = 4
TURN = list(range(10, 20))  # 10 tokens: 2 full blocks and a tail of 2 (18, 19)


def finished(bm: BlockManager, tokens: list[int] = TURN, **kwargs) -> int:
    """A sequence that computed ``tokens`` and was freed: the block id of its tail."""
    alloc = computed_blocks(bm, "turn-1", tokens, **kwargs)
    bm.free("turn-1")
    return alloc.block_ids[len(tokens) // BS]


def take(bm: BlockManager, sid: str, tokens: list[int], **kwargs):
    alloc = bm.allocate(sid, tokens, take_tail=True, **kwargs)
    bm.check_invariants()
    return alloc


def test_a_prompt_that_extends_a_finished_sequence_takes_its_tail():
    bm = BlockManager(num_blocks=16, block_size=BS)
    tail = finished(bm)
    alloc = take(bm, "turn-2", TURN + [30, 31, 32])
    assert alloc.num_cached_tokens == 10 and alloc.block_ids[2] == tail
    assert len(alloc.block_ids) == 4  # 13 tokens


def test_the_hit_counters_count_a_tails_tokens():
    """pdserve:prefix_cache_hits_total is in tokens and equals what usage reports as cached, so a
    tail's tokens count as hits, and the room past the full blocks as looked up (a metric that
    counted whole blocks only said 32 where 37 prompt tokens were cached)."""
    bm = BlockManager(num_blocks=16, block_size=BS)
    finished(bm)
    queries, hits = bm.prefix_queries, bm.prefix_hits
    alloc = take(bm, "turn-2", TURN + [30, 31, 32])  # 13 tokens: 12 eligible, 10 found
    assert (bm.prefix_queries - queries, bm.prefix_hits - hits) == (12, alloc.num_cached_tokens) == (12, 10)


def test_a_partial_match_takes_only_the_shared_tokens():
    bm = BlockManager(num_blocks=16, block_size=BS)
    tail = finished(bm)
    alloc = take(bm, "turn-2", TURN[:9] + [99, 98])
    assert alloc.num_cached_tokens == 9 and alloc.block_ids[2] == tail


@pytest.mark.parametrize("prompt, salt", [(TURN[:8] + [99, 19, 1], ""), (TURN + [1], "other")])
def test_another_token_or_another_salt_takes_no_tail(prompt, salt):
    bm = BlockManager(num_blocks=16, block_size=BS)
    tail = finished(bm)
    alloc = take(bm, "turn-2", prompt, cache_salt=salt)
    assert alloc.num_cached_tokens == (0 if salt else 8) and tail not in alloc.block_ids


def test_the_last_prompt_token_is_always_left_to_compute():
    bm = BlockManager(num_blocks=16, block_size=BS)
    tail = finished(bm)
    again = take(bm, "same", TURN)  # the whole previous sequence again
    assert again.num_cached_tokens == 9 and again.block_ids[2] == tail
    bm.free("same")
    assert take(bm, "shorter", TURN[:9]).num_cached_tokens == 8  # its one tail token is its last


def test_a_tail_is_taken_once_and_what_its_taker_made_final_is_the_next_tail():
    bm = BlockManager(num_blocks=16, block_size=BS)
    tail = finished(bm)
    prompt = TURN + [30, 31, 32]
    assert take(bm, "a", prompt).block_ids[2] == tail
    b = take(bm, "b", prompt)  # "a" holds it and has computed nothing past it
    assert b.num_cached_tokens == 8 and tail not in b.block_ids
    bm.free("b")
    bm.free("a")  # aborted before its step: its tail is the 2 tokens it took, no more
    assert take(bm, "c", prompt).num_cached_tokens == 10
    bm.mark_final("c", prompt, 11)  # a chunk computed 30 only
    bm.free("c")
    assert take(bm, "d", prompt + [40]).num_cached_tokens == 11  # 2 blocks and 18, 19, 30: 31 never ran


def test_only_final_tokens_make_a_tail():
    bm = BlockManager(num_blocks=16, block_size=BS)
    bm.allocate("a", TURN)
    bm.free("a")  # aborted before any step
    assert take(bm, "b", TURN + [1]).num_cached_tokens == 0
    bm.free("b")
    bm.allocate("c", TURN)
    bm.mark_final("c", TURN, 6)  # a first chunk of 6: one block and a tail of 2 (14, 15)
    bm.free("c")
    assert take(bm, "d", TURN + [1]).num_cached_tokens == 6


def test_the_tail_follows_decode_steps():
    bm = BlockManager(num_blocks=16, block_size=BS)
    tokens = list(TURN)
    computed_blocks(bm, "a", tokens)
    for token in (20, 21, 22):  # the answer: the last token sampled is never computed
        tokens.append(token)
        assert bm.append_slots("a", tokens)
        bm.mark_final("a", tokens, len(tokens) - 1)
    bm.free("a")  # final: 12 tokens, 3 full blocks, and 22's KV was never written
    assert take(bm, "b", tokens + [50]).num_cached_tokens == 12


def test_the_longest_of_several_branches_is_taken():
    bm = BlockManager(num_blocks=16, block_size=BS)
    short = finished(bm, TURN[:8] + [1])
    long = computed_blocks(bm, "turn-1b", TURN[:8] + [1, 2, 3]).block_ids[2]
    bm.free("turn-1b")
    alloc = take(bm, "turn-2", TURN[:8] + [1, 2, 3, 4, 5])
    assert alloc.num_cached_tokens == 11 and alloc.block_ids[2] == long
    assert take(bm, "other", TURN[:8] + [1, 7]).block_ids[2] == short


def test_a_parent_keeps_only_its_newest_tails_so_a_lookup_stays_short():
    """Short chats that share a template's first block leave their tails under one parent."""
    bm = BlockManager(num_blocks=64, block_size=BS)
    tails = [finished(bm, TURN[:8] + [100 + i]) for i in range(MAX_TAILS_PER_PARENT + 1)]
    assert take(bm, "oldest", TURN[:8] + [100, 1]).num_cached_tokens == 8
    bm.free("oldest")
    newest = take(bm, "newest", TURN[:8] + [100 + MAX_TAILS_PER_PARENT, 1])
    assert newest.num_cached_tokens == 9 and newest.block_ids[2] == tails[-1]


def test_eviction_drops_the_tail():
    bm = BlockManager(num_blocks=4, block_size=BS)
    finished(bm)
    bm.allocate("fill", list(range(100, 116)))  # every block, the tail's first
    bm.free("fill")
    bm.check_invariants()
    assert take(bm, "turn-2", TURN + [1]).num_cached_tokens == 0


def test_a_tail_is_never_a_hash_a_router_or_a_reader_can_find():
    bm = BlockManager(num_blocks=16, block_size=BS)
    events = []
    bm.subscribe(lambda h, cached: events.append(cached))
    finished(bm)
    assert events == [True, True] and len(bm.cached_hashes()) == 2  # the 2 full blocks only
    assert bm.share_prefix("hold", TURN + [1]).num_cached_tokens == 8
    assert bm.allocate("pin", TURN + [1]).num_cached_tokens == 8  # no take_tail: whole blocks only


def test_a_pull_never_takes_a_tail():
    """A decode worker's read-back writes whole blocks past its hits: a tail's final slots
    would be overwritten, so ``add_remote_prefilled`` takes none."""
    bm = BlockManager(num_blocks=16, block_size=BS)
    tail = finished(bm)
    sched = Scheduler(SchedulerConfig(), bm, max_model_len=100)
    seq = Sequence("pulled", TURN + [1, 2, 7], SamplingParams(max_tokens=4), num_prompt_tokens=12)
    ids = sched.add_remote_prefilled(seq, reuse_cached=True)
    assert seq.num_cached_tokens == 8 and tail not in ids
    bm.check_invariants()


def test_no_tail_without_the_prefix_cache():
    bm = BlockManager(num_blocks=16, block_size=BS, enable_prefix_cache=False)
    finished(bm)
    assert take(bm, "turn-2", TURN + [1]).num_cached_tokens == 0
