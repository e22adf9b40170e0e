"""The router's local load accounting between two stats polls, and turn-taking among idle workers."""

from pdserve.protos import worker_pb2
from pdserve.router.policy import pick_decode
from pdserve.router.pool import WorkerClient, WorkerPool


def client():
    return WorkerClient("decode", "127.0.0.1:1", channel=None, stub=None, healthy=True)


def test_load_placed_since_the_last_poll_counts_until_it_leaves():
    pool, c = WorkerPool(), client()
    with pool.placed(c, tokens=100, blocks=7):
        assert c.snapshot().blocks_used == 7 and c.snapshot().queued_tokens == 100 and c.inflight == 1
    assert (c.local_blocks, c.local_tokens, c.inflight) == (0, 0, 0)


def test_load_already_in_the_workers_stats_is_not_subtracted_twice():
    pool, c = WorkerPool(), client()
    with pool.placed(c, blocks=7):
        c.local_blocks, c.epoch = 0, c.epoch + 1  # a poll happened: the worker now reports it
        with pool.placed(c, blocks=3):
            pass
    assert c.local_blocks == 0


def test_idle_workers_take_turns_for_requests_one_at_a_time():
    """A lone client's sequential requests find every worker idle; they must still spread
    (a fresh replica gets work at once instead of waiting for load to build up)."""
    pool = WorkerPool()
    workers = {a: WorkerClient("decode", a, channel=None, stub=None, healthy=True) for a in ("b:1", "a:1", "c:1")}
    for c in workers.values():
        c.stats = worker_pb2.WorkerStats(num_blocks_total=100)
    picked = []
    for _ in range(6):
        choice = pick_decode([c.snapshot() for c in workers.values()], blocks_needed=2)
        with pool.placed(workers[choice.worker_id], blocks=2):
            picked.append(choice.worker_id)
    assert picked == ["a:1", "b:1", "c:1"] * 2


def test_a_prefill_worker_whose_kv_transfers_keep_failing_is_down_for_routing():
    """Its Stats answer fine (a worker restarted under the same address, say), so only the
    failed pulls tell; a success in between starts the count again."""
    from pdserve.router.pool import MAX_TRANSFER_FAILURES

    pool = WorkerPool()
    bad, good = (WorkerClient("prefill", a, channel=None, stub=None, healthy=True) for a in ("bad:1", "good:1"))
    pool.workers = {"bad:1": bad, "good:1": good}
    for _ in range(MAX_TRANSFER_FAILURES - 1):
        pool.transfer_failed("bad:1")
    pool.transfer_ok("bad:1")
    for _ in range(MAX_TRANSFER_FAILURES - 1):
        pool.transfer_failed("bad:1")
    assert bad.snapshot().healthy  # never MAX_TRANSFER_FAILURES in a row yet
    pool.transfer_failed("bad:1")
    bad.healthy = True  # as the next Stats poll sets it
    assert not bad.snapshot().healthy and good.snapshot().healthy
