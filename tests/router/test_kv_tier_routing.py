"""The router and the workers' KV tiers (issue 58): the index learns each worker's
``kv_tier_id`` and the tier's events (``in_tier``), counts a block stored by any worker of a
tier for every worker of that tier, after the worker's cached prefix; the kv policy charges
tier tokens at ``tier_weight``, and the pool's poll and choice put both together."""

import asyncio

import pytest
import torch

from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.kv_tier.tier import KVTier
from pdserve.protos import worker_pb2
from pdserve.router.kv_index import KVIndex, prompt_block_hashes
from pdserve.router.kv_policy import RoutingConfig, choose_prefill, cost, pick_prefill_kv
from pdserve.router.policy import WorkerSnapshot
from pdserve.router.pool import WorkerClient, WorkerPool
from pdserve.shell.cache_events import CacheEventLog
from tests.factories import computed_blocks

BS = 4
PROMPT = list(range(100, 141))  # 41 tokens: 10 blocks a hit can cover
H = prompt_block_hashes(PROMPT, BS)


def events(seq, hashes, cached=None, in_tier=None, snapshot=False, epoch="e"):
    n = len(hashes)
    return worker_pb2.CacheEvents(epoch=epoch, last_seq=seq, snapshot=snapshot, block_hashes=hashes,
                                  cached=[True] * n if cached is None else cached,
                                  in_tier=[False] * n if in_tier is None else in_tier)


def snapshot(device, tier, seq=1):
    return events(seq, [*device, *tier], in_tier=[False] * len(device) + [True] * len(tier), snapshot=True)


def test_tier_tokens_follow_the_cached_prefix_and_count_for_every_worker_sharing_the_tier():
    index = KVIndex()
    index.apply("a", snapshot(H[:2], H[2:6]), BS, "host1:/dev/shm/t")  # a cached 2 blocks, stored 4 in the tier
    index.apply("b", snapshot(H[:1], []), BS, "host1:/dev/shm/t")  # b shares the tier, stored nothing there
    index.apply("c", snapshot(H[:3], []), BS, "host2:/dev/shm/t")  # another host's tier
    index.apply("d", snapshot(H[:2], []), BS)  # no tier
    cached = index.overlaps(PROMPT, ["a", "b", "c", "d"])
    assert cached == {"a": 8, "b": 4, "c": 12, "d": 8}  # device tokens: the tier changes nothing there
    # a: blocks 2..5 after its 2; b: nothing at block 1 (the run must start where its cache stops);
    # c and d: no such tier
    assert index.tier_tokens(PROMPT, cached) == {"a": 16, "b": 0, "c": 0, "d": 0}
    index.apply("b", events(2, [H[1]]), BS, "host1:/dev/shm/t")  # b caches block 1: now the shared tier goes on
    assert index.tier_tokens(PROMPT, index.overlaps(PROMPT, ["b"])) == {"b": 16}
    assert index.tier_tokens(PROMPT, {"a": 8}, cache_salt="other tenant") == {"a": 0}


def test_a_removal_by_any_worker_of_the_tier_removes_the_block_for_all():
    index, tier = KVIndex(), "h:/t"
    index.apply("a", snapshot([], H[:4]), BS, tier)
    index.apply("b", snapshot([], []), BS, tier)
    assert index.tier_tokens(PROMPT, {"a": 0, "b": 0}) == {"a": 16, "b": 16}
    index.apply("b", events(2, [H[2]], cached=[False], in_tier=[True]), BS, tier)  # b's LRU deleted a's file
    assert index.tier_tokens(PROMPT, {"a": 0, "b": 0}) == {"a": 8, "b": 8}
    assert index.num_tier_blocks(tier) == 3


def test_events_in_order_store_and_remove_tier_blocks_and_a_worker_that_leaves_takes_its_stores_along():
    index, tier = KVIndex(), "h:/t"
    index.apply("a", snapshot([], []), BS, tier)
    index.apply("a", events(4, [H[0], H[0], H[1], H[1]], cached=[False, True, True, False],
                            in_tier=[False, True, True, True]), BS, tier)  # evicted from memory, moved down
    assert index.overlaps(PROMPT, ["a"]) == {"a": 0} and index.tier_tokens(PROMPT, {"a": 0}) == {"a": 4}
    index.apply("b", snapshot([], [H[1]]), BS, tier)
    index.remove("a")
    assert index.num_tier_blocks(tier) == 1 and index.tier_tokens(PROMPT, {"b": 0}) == {"b": 0}  # H[0] went with a
    index.apply("b", snapshot([], [H[1]], seq=9), BS, "h:/other")  # b's tier moved: its stores move with it
    assert index.num_tier_blocks(tier) == 0 and index.num_tier_blocks("h:/other") == 1


def test_tier_events_from_a_worker_without_a_tier_id_count_for_nobody():
    index = KVIndex()
    index.apply("a", snapshot([], H[:3]), BS)
    assert index.tier_tokens(PROMPT, {"a": 0}) == {"a": 0}


def test_a_worker_log_with_a_tier_feeds_the_index_through_the_wire_message():
    log = CacheEventLog(capacity=64)
    for h in H[:3]:
        log.record(h, True)
    for h in H[3:5]:
        log.record_tier(h, True)
    index = KVIndex()
    for after in (0, 3):  # a snapshot first, then the events after the router's number
        batch = log.since(*index.cursor("w"))
        index.apply("w", worker_pb2.CacheEvents(epoch=batch.epoch, last_seq=batch.last_seq, snapshot=batch.snapshot,
                                                block_hashes=batch.hashes, cached=batch.cached,
                                                in_tier=batch.in_tier), BS, "h:/t")
        log.record_tier(H[5], True)
    assert index.overlaps(PROMPT, ["w"]) == {"w": 12} and index.tier_tokens(PROMPT, {"w": 12}) == {"w": 12}


def polled(index: KVIndex, worker: str, log: CacheEventLog, tier_id: str) -> None:
    """One router poll of ``worker``'s log, through the wire message."""
    batch = log.since(*index.cursor(worker))
    index.apply(worker, worker_pb2.CacheEvents(epoch=batch.epoch, last_seq=batch.last_seq, snapshot=batch.snapshot,
                                               block_hashes=batch.hashes, cached=batch.cached,
                                               in_tier=batch.in_tier), BS, tier_id)


def test_a_worker_that_restarts_or_joins_over_a_filled_tier_announces_its_blocks_at_once(tmp_path):
    """The tier's directory outlives its workers: a worker's log starts from the blocks the
    directory holds (their files' names), so the router scores them before anything is written
    again, whether the worker restarted or joined a directory that another worker filled."""
    def worker():  # a block manager of 8 blocks of BS tokens over a tier in tmp_path
        bm, tier = BlockManager(8, BS), KVTier(torch.zeros(8, 8), str(tmp_path), 1 << 20)
        bm.attach_tier(tier)
        return bm, tier

    bm, tier = worker()
    computed_blocks(bm, "a", PROMPT[:4 * BS + 1])  # 4 full blocks cached ...
    bm.free("a")
    bm.allocate("b", list(range(8 * BS)))  # ... and all of them evicted: down to the tier
    tier.close()  # the worker stops; its files stay
    index = KVIndex()
    restarted, tier = worker()
    polled(index, "w", CacheEventLog.following(restarted, 64, tier), tier.tier_id)
    assert index.tier_tokens(PROMPT, {"w": 0}) == {"w": 4 * BS}
    joined, other = worker()  # a second worker of the host, with its own log
    polled(index, "v", CacheEventLog.following(joined, 64, other), other.tier_id)
    index.remove("w")  # the first one leaves: the blocks stay known through the second
    assert index.tier_tokens(PROMPT, {"v": 0}) == {"v": 4 * BS} and index.num_tier_blocks(tier.tier_id) == 4
    tier.close()
    other.close()


def w(worker_id, queued=0):
    return WorkerSnapshot(worker_id, "prefill", True, queued_tokens=queued)


def test_the_cost_charges_tier_tokens_at_tier_weight_instead_of_prefill_weight():
    config = RoutingConfig()
    assert config.tier_weight == 0.1
    assert cost(w("a", 50), 1000, 200, config, tier_tokens=600) == pytest.approx(200 + 0.1 * 600 + 50)
    assert cost(w("a"), 1000, 200, config) == 800
    with pytest.raises(ValueError, match="tier_weight must be at least 0, got -1"):
        RoutingConfig(tier_weight=-1)


def test_a_tier_hit_beats_a_miss_and_loses_to_the_same_tokens_cached():
    workers = [w("miss"), w("tier"), w("cached")]
    choice = pick_prefill_kv(workers[:2], {}, 1000, RoutingConfig(), tier_overlaps={"tier": 900})
    assert choice.worker_id == "tier" and choice.rule == "cache" and choice.cached_tokens == 900
    assert "900 more in its KV tier" in choice.reason
    choice = pick_prefill_kv(workers, {"cached": 900}, 1000, RoutingConfig(), tier_overlaps={"tier": 900})
    assert choice.worker_id == "cached" and choice.cached_tokens == 900
    # tier_weight as prefill_weight: a tier token costs a computed one, so one queued token decides
    flat = pick_prefill_kv([w("tier", queued=1), w("miss")], {}, 1000, RoutingConfig(tier_weight=1.0),
                           tier_overlaps={"tier": 900})
    assert flat.worker_id == "miss" and "lowest cost 1000 " in flat.reason


def test_cache_and_tier_together_never_cover_the_last_token():
    choice = pick_prefill_kv([w("a"), w("b", queued=10_000)], {"a": 64}, 100, RoutingConfig(),
                             tier_overlaps={"a": 64})
    assert choice.worker_id == "a" and choice.cached_tokens == 99
    load = choose_prefill([w("a")], {"a": 64}, 100, RoutingConfig(policy="load"), 0, tier_overlaps={"a": 64})
    assert load.cached_tokens == 99  # reported for every policy


class _Stub:
    """A worker's Stats answer: its tier's id, and a snapshot with one block cached and the
    next three in the tier."""

    def __init__(self, tier_id: str, device, tier):
        self.stats = worker_pb2.WorkerStats(role="prefill", block_size=BS, kv_tier_id=tier_id,
                                            cache_events=snapshot(device, tier))

    async def Stats(self, request, timeout=None):
        answer = worker_pb2.WorkerStats()
        answer.CopyFrom(self.stats)
        return answer


def test_the_pool_learns_each_workers_tier_at_its_poll_and_routes_to_the_tier_hit():
    async def main():
        pool = WorkerPool()
        pool.workers = {"p0:1": WorkerClient("prefill", "p0:1", channel=None, stub=_Stub("", H[:1], []), healthy=True),
                        "p1:1": WorkerClient("prefill", "p1:1", channel=None, stub=_Stub("h:/t", H[:1], H[1:4]),
                                             healthy=True)}
        await pool.refresh()
        assert pool.index.tier_ids == {"p1:1": "h:/t"}
        choice = pool.route_prefill(PROMPT, RoutingConfig())
        assert choice.worker_id == "p1:1" and choice.cached_tokens == 16

    asyncio.run(main())
