"""The router's local load accounting between two stats polls."""

from router.pool import WorkerClient, WorkerPool


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
