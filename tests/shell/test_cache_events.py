"""The prefix-cache events a worker (either role) publishes: what the block manager emits, the
numbered log that serves them to routers' polls, and that held blocks are never evicted."""

import pytest

from pdserve.engine.core.block_manager import NO_HASH, BlockManager, chain_hash
from pdserve.shell.cache_events import CacheEventLog
from tests.factories import computed_blocks



def recording(bm: BlockManager) -> list[tuple[bytes, bool]]:
    events: list[tuple[bytes, bool]] = []
    bm.subscribe(lambda h, cached: events.append((h, cached)))
    return events


def test_full_blocks_are_announced_once_and_evicted_when_handed_out_again():
    bm = BlockManager(num_blocks=4, block_size=4)
    events = recording(bm)
    prompt = list(range(10, 19))  # 2 full blocks + 1 token
    bm.allocate("a", prompt)
    assert events == []  # nothing is announced before its KV is final
    bm.mark_final("a", prompt, len(prompt))
    h1 = chain_hash(NO_HASH, prompt[:4])
    h2 = chain_hash(h1, prompt[4:8])
    assert events == [(h1, True), (h2, True)]
    bm.allocate("b", prompt)  # a hit: nothing new is cached
    bm.free("a")
    bm.free("b")
    assert events == [(h1, True), (h2, True)]  # freed blocks stay cached
    bm.allocate("c", list(range(100, 116)))  # 4 fresh blocks: every old one is handed out again
    evicted = [h for h, cached in events if not cached]
    assert sorted(evicted) == sorted([h1, h2])
    assert set(bm.cached_hashes()) == {h for h, cached in events[2:] if cached}


def test_a_second_copy_of_a_cached_prefix_announces_nothing():
    bm = BlockManager(num_blocks=8, block_size=4)
    events = recording(bm)
    prompt = [1, 2, 3, 4, 5]
    computed_blocks(bm, "a", prompt, use_prefix_cache=False)  # computes its own copy of block 1
    computed_blocks(bm, "b", prompt, use_prefix_cache=False)  # and another
    assert events == [(chain_hash(NO_HASH, [1, 2, 3, 4]), True)]


def test_no_events_without_the_prefix_cache():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_cache=False)
    events = recording(bm)
    computed_blocks(bm, "a", list(range(12)))
    bm.free("a")
    computed_blocks(bm, "b", list(range(50, 66)))
    assert events == []


def test_blocks_held_by_a_sequence_are_never_evicted_or_reused():
    """A prefill worker's held KV (a lease) is a sequence that still references its blocks:
    however hard the cache is pressed, its blocks stay its own and its hashes stay cached."""
    bm = BlockManager(num_blocks=8, block_size=4)
    events = recording(bm)
    held = computed_blocks(bm, "held", list(range(200, 213)))  # 4 blocks, 3 full
    held_hashes = {h for h, _ in events}
    for i in range(50):  # churn: sequences of 1 to 4 blocks fill what is left, then leave
        seq = f"s{i}"
        n = 1 + i % 4
        computed_blocks(bm, seq, list(range(1000 * i, 1000 * i + 4 * n)))
        assert not set(bm.block_table(seq)) & set(held.block_ids)
        bm.free(seq)
    assert bm.block_table("held") == list(held.block_ids)
    assert not {h for h, cached in events if not cached} & held_hashes
    bm.free("held")
    bm.allocate("big", list(range(5000, 5032)))  # all 8 blocks: now the held prefix goes
    assert held_hashes <= {h for h, cached in events if not cached}


def test_the_log_gives_each_poll_the_events_after_its_number():
    log = CacheEventLog(capacity=8)
    for i in range(5):
        log.record(bytes([i]), i != 3)
    batch = log.since(log.epoch, 2)
    assert (batch.snapshot, batch.last_seq, batch.hashes, batch.cached) == (False, 5, (b"\x02", b"\x03", b"\x04"),
                                                                             (True, False, True))
    assert log.since(log.epoch, 5).hashes == () and not log.since(log.epoch, 5).snapshot


@pytest.mark.parametrize("epoch, after", [("", 0), ("other", 3), ("mine", 1), ("mine", 99)])
def test_a_poll_that_cannot_be_answered_with_events_gets_a_snapshot(epoch, after):
    """Never asked, another incarnation of the log (the worker restarted), events dropped
    (capacity 4 keeps 7..10, so after 1 misses 2..6), or a number from the future."""
    log = CacheEventLog(capacity=4, initial=[b"old"])
    for i in range(10):
        log.record(bytes([i]), True)
    log.record(b"old", False)
    batch = log.since(log.epoch if epoch == "mine" else epoch, after)
    assert batch.snapshot and batch.epoch == log.epoch and batch.last_seq == 11
    assert set(batch.hashes) == {bytes([i]) for i in range(10)} and all(batch.cached)


def test_an_empty_log_answers_its_epoch_with_no_events():
    log = CacheEventLog(capacity=4)
    assert log.since(log.epoch, 0).hashes == () and not log.since(log.epoch, 0).snapshot
    assert log.since("", 0).snapshot
    with pytest.raises(ValueError, match="capacity"):
        CacheEventLog(capacity=0)


class _Tier:
    """The KV tier's event side (``KVTier.subscribe``): what the log listens to."""

    def __init__(self, on_disk=()):
        self.listeners = []
        self.on_disk = list(on_disk)  # what its directory holds when the log is made

    def subscribe(self, listener):
        self.listeners.append(listener)

    def stored_hashes(self):
        return self.on_disk

    def emit(self, block_hash: bytes, stored: bool):
        for listener in self.listeners:
            listener(block_hash, stored)


def test_the_tiers_events_are_numbered_with_the_caches_and_marked_in_tier():
    bm, tier = BlockManager(num_blocks=4, block_size=4), _Tier()
    log = CacheEventLog.following(bm, 16, tier)
    computed_blocks(bm, "a", list(range(9)))  # 2 full blocks cached
    h1, h2 = chain_hash(NO_HASH, [0, 1, 2, 3]), chain_hash(chain_hash(NO_HASH, [0, 1, 2, 3]), [4, 5, 6, 7])
    tier.emit(h1, True)  # the engine stored it in its tier (an eviction moved it down) ...
    tier.emit(b"gone", True)
    tier.emit(b"gone", False)  # ... and removed another (LRU)
    batch = log.since(log.epoch, 0)
    assert batch.hashes == (h1, h2, h1, b"gone", b"gone")
    assert batch.cached == (True, True, True, True, False)
    assert batch.in_tier == (False, False, True, True, True)
    assert log.since(log.epoch, 2).in_tier == (True, True, True)


def test_a_snapshot_carries_the_cached_set_and_the_tier_set_each_marked():
    log, tier = CacheEventLog(capacity=2, initial=[b"dev"]), _Tier()
    tier.subscribe(log.record_tier)
    for i in range(4):
        tier.emit(bytes([i]), True)
    tier.emit(bytes([0]), False)
    log.record(b"both", True)
    tier.emit(b"both", True)  # a block loaded back stays in the tier too: listed once each way
    batch = log.since("", 0)
    assert batch.snapshot and all(batch.cached) and len(batch.hashes) == len(batch.in_tier) == 6
    marked = sorted(zip(batch.hashes, batch.in_tier))
    assert marked == sorted([(b"dev", False), (b"both", False), (bytes([1]), True), (bytes([2]), True),
                             (bytes([3]), True), (b"both", True)])


def test_what_a_queued_prompt_will_not_compute_goes_on_in_the_tier_where_the_cache_stops():
    log = CacheEventLog(capacity=8, initial=[b"a"])
    log.record_tier(b"b", True)
    log.record_tier(b"c", True)
    assert log.cached_prefix([b"a", b"b", b"c", b"d"]) == 3
    assert log.cached_prefix([b"x", b"b"]) == 0  # the lookup starts in KV memory ...
    assert log.cached_prefix([b"b", b"c", b"a"]) == 2  # ... and never comes back to it from the tier
    log.record_tier(b"b", False)
    assert log.cached_prefix([b"a", b"b", b"c"]) == 1


def test_a_log_without_a_tier_marks_nothing_in_tier():
    bm = BlockManager(num_blocks=4, block_size=4)
    log = CacheEventLog.following(bm, 16)
    computed_blocks(bm, "a", list(range(9)))
    assert log.since(log.epoch, 0).in_tier == (False, False) and log.since("", 0).in_tier == (False, False)
