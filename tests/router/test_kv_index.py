"""The router's KV index (router.kv_index): fed by the workers' cache events over the same
wire message the Stats poll carries, it mirrors each worker's prefix cache, and its overlaps
are the longest runs of consecutive cached blocks."""

import random

from pdserve.engine.core.block_manager import BlockManager
from pdserve.shell.cache_events import CacheEventBatch, CacheEventLog
from pdserve.protos import worker_pb2
from pdserve.router.kv_index import KVIndex, prompt_block_hashes
from tests.factories import computed_blocks


def wire(batch: CacheEventBatch) -> worker_pb2.CacheEvents:
    return worker_pb2.CacheEvents(epoch=batch.epoch, last_seq=batch.last_seq, snapshot=batch.snapshot,
                                  block_hashes=batch.hashes, cached=batch.cached)


def poll(index: KVIndex, worker: str, log: CacheEventLog, block_size: int) -> CacheEventBatch:
    batch = log.since(*index.cursor(worker))
    index.apply(worker, wire(batch), block_size)
    return batch


def worker(num_blocks=64, block_size=4, capacity=1024):
    bm = BlockManager(num_blocks, block_size)
    log = CacheEventLog(capacity, bm.cached_hashes())
    bm.subscribe(log.record)
    return bm, log


def test_the_router_hashes_a_prompt_as_the_worker_caches_it():
    bm, log = worker()
    prompt = list(range(100, 123))  # 5 full blocks of 4 + 3 tokens
    computed_blocks(bm, "a", prompt)
    assert prompt_block_hashes(prompt, 4) == list(log.since(log.epoch, 0).hashes)  # in event order
    assert len(prompt_block_hashes(prompt[:20], 4)) == 4  # exact blocks: the last one is computed
    assert prompt_block_hashes([], 4) == [] and prompt_block_hashes([1, 2, 3], 4) == []


def test_overlap_is_the_longest_consecutive_prefix_per_worker():
    index, prompt = KVIndex(), list(range(40))
    h = prompt_block_hashes(prompt, 4)  # 9 blocks
    index.apply("a", worker_pb2.CacheEvents(epoch="e", last_seq=3, snapshot=True, block_hashes=h[:3]), 4)
    index.apply("b", worker_pb2.CacheEvents(epoch="e", last_seq=5, snapshot=True,
                                            block_hashes=h[:2] + h[3:6]), 4)  # a hole at block 2
    index.apply("c", worker_pb2.CacheEvents(epoch="e", last_seq=1, snapshot=True, block_hashes=h[1:]), 4)
    assert index.overlaps(prompt, ["a", "b", "c", "unknown"]) == {"a": 12, "b": 8, "c": 0, "unknown": 0}


def test_workers_with_other_block_sizes_are_matched_with_their_own_hashes():
    index, prompt = KVIndex(), list(range(40))
    index.apply("small", worker_pb2.CacheEvents(epoch="e", last_seq=1, snapshot=True,
                                                block_hashes=prompt_block_hashes(prompt, 4)), 4)
    index.apply("big", worker_pb2.CacheEvents(epoch="e", last_seq=1, snapshot=True,
                                              block_hashes=prompt_block_hashes(prompt, 16)[:1]), 16)
    assert index.overlaps(prompt, ["small", "big"]) == {"small": 36, "big": 16}


def test_incremental_events_apply_in_order_once_even_when_answers_overlap():
    bm, log = worker(num_blocks=4)
    index = KVIndex()
    poll(index, "w", log, 4)  # the first poll: a snapshot (empty)
    before = index.cursor("w")
    a = list(range(9))
    computed_blocks(bm, "a", a)
    early = log.since(*before)  # two polls in flight with the same cursor
    bm.free("a")
    computed_blocks(bm, "b", list(range(50, 66)))  # all 4 blocks: a's prefix is evicted
    late = log.since(*before)
    assert not early.snapshot and not late.snapshot and len(late.hashes) > len(early.hashes)
    index.apply("w", wire(late), 4)
    index.apply("w", wire(early), 4)  # older than the cursor: skipped, not re-applied
    assert index.cursor("w") == (log.epoch, log.last_seq)
    assert index.num_blocks("w") == len(bm.cached_hashes()) == 4
    assert index.overlaps(a, ["w"]) == {"w": 0}


def test_a_new_epoch_replaces_the_view_and_a_misaligned_batch_forces_a_snapshot():
    index = KVIndex()
    index.apply("w", worker_pb2.CacheEvents(epoch="old", last_seq=9, snapshot=True, block_hashes=[b"x", b"y"]), 4)
    index.apply("w", worker_pb2.CacheEvents(epoch="new", last_seq=1, snapshot=True, block_hashes=[b"z"]), 4)
    assert index.num_blocks("w") == 1 and index.cursor("w") == ("new", 1)
    # Events 5..6 when the router has only 1: they cannot line up, so it asks afresh.
    index.apply("w", worker_pb2.CacheEvents(epoch="new", last_seq=6, block_hashes=[b"p", b"q"],
                                            cached=[True, True]), 4)
    assert index.cursor("w") == ("", 0) and index.num_blocks("w") == 1


def test_removing_a_worker_forgets_its_blocks():
    index, prompt = KVIndex(), list(range(20))
    h = prompt_block_hashes(prompt, 4)
    for name in ("a", "b"):
        index.apply(name, worker_pb2.CacheEvents(epoch="e", last_seq=1, snapshot=True, block_hashes=h), 4)
    index.remove("a")
    assert index.overlaps(prompt, ["a", "b"]) == {"a": 0, "b": 16} and index.cursor("a") == ("", 0)


def test_batches_without_an_epoch_are_ignored():
    index = KVIndex()
    index.apply("decode", worker_pb2.CacheEvents(), 16)
    assert index.cursor("decode") == ("", 0) and index.overlaps([1] * 40, ["decode"]) == {"decode": 0}


def test_a_random_workload_keeps_the_index_equal_to_the_cache():
    """Many polls, through the wire message, with a log so small that some polls fall behind
    and get snapshots: after each poll the index is exactly the worker's cached set."""
    rng = random.Random(5)
    bm, log = worker(num_blocks=24, block_size=4, capacity=6)
    index, live, snapshots = KVIndex(), [], 0
    prefixes = [[rng.randrange(1000) for _ in range(12)] for _ in range(5)]
    for step in range(300):
        if live and (rng.random() < 0.5 or bm.num_free_blocks < 6):
            bm.free(live.pop(rng.randrange(len(live))))
        else:
            prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 10))]
            seq = f"s{step}"
            computed_blocks(bm, seq, prompt)
            live.append(seq)
        if rng.random() < 0.4:
            snapshots += poll(index, "w", log, 4).snapshot
            hashes = set(bm.cached_hashes())
            assert index.num_blocks("w") == len(hashes)
            for p in prefixes:
                assert index.overlaps(p + [0], ["w"])["w"] == 4 * sum(
                    1 for _ in iter_prefix(prompt_block_hashes(p + [0], 4), hashes))
    assert snapshots > 1  # the snapshot path ran, not only the first poll


def iter_prefix(hashes, cached):
    for h in hashes:
        if h not in cached:
            return
        yield h
