"""The router's local load accounting between two stats polls, and turn-taking among idle workers."""

from pdserve.protos import worker_pb2
from pdserve.router.policy import WorkerSnapshot, avoiding, pick_decode
from pdserve.router.pool import WorkerClient, WorkerPool
from pdserve.router.transfer_faults import MAX_TRANSFER_FAILURES


def d(name: str, used: int) -> WorkerSnapshot:
    return WorkerSnapshot(name, "decode", True, blocks_used=used, blocks_total=100)


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
    """(pdserve.router.transfer_faults) Its Stats answer fine (a worker restarted under the
    same address, say), so only the failed pulls tell; a success in between starts the count
    again. The readers of its failed transfers are not blamed for the one that takes it down."""
    pool = WorkerPool()
    bad, good = (WorkerClient("prefill", a, channel=None, stub=None, healthy=True) for a in ("bad:1", "good:1"))
    readers = [WorkerClient("decode", a, channel=None, stub=None, healthy=True) for a in ("r1:1", "r2:1")]
    pool.workers = {c.address: c for c in (bad, good, *readers)}
    for n in range(MAX_TRANSFER_FAILURES - 1):
        pool.transfer_failed("bad:1", readers[n % 2].address)
    pool.transfer_ok("bad:1", "r1:1")
    for n in range(MAX_TRANSFER_FAILURES - 1):
        pool.transfer_failed("bad:1", readers[n % 2].address)
    assert bad.snapshot().healthy  # never MAX_TRANSFER_FAILURES in a row yet
    pool.transfer_failed("bad:1", "r2:1")  # r2's third in a row too: laid on bad, which it takes down
    bad.healthy = True  # as the next Stats poll sets it
    assert not bad.snapshot().healthy and good.snapshot().healthy
    assert all(r.snapshot().healthy for r in readers)


def test_a_reader_whose_reads_keep_failing_is_down_while_another_reader_is_routable():
    """A decode worker that never receives (the holder sees it close the connection) fails
    reads from every holder: it goes down for routing, as a holder would, unless it is the last
    decode worker routable (then the requests would have nowhere to go)."""
    pool = WorkerPool()
    sources = [WorkerClient("prefill", a, channel=None, stub=None, healthy=True) for a in ("p1:1", "p2:1")]
    stalled, other = (WorkerClient("decode", a, channel=None, stub=None, healthy=True) for a in ("r1:1", "r2:1"))
    pool.workers = {c.address: c for c in (*sources, stalled, other)}
    for n in range(MAX_TRANSFER_FAILURES):
        pool.transfer_failed(sources[n % 2].address, "r1:1")
        pool.transfer_ok(sources[n % 2].address, "r2:1")  # the sources serve the other reader meanwhile
    assert not stalled.snapshot().healthy and other.snapshot().healthy
    assert all(s.snapshot().healthy for s in sources)

    other.draining = True  # now the stalled one is the only decode worker left
    stalled.down_until = 0.0
    for _ in range(MAX_TRANSFER_FAILURES):
        pool.transfer_failed("p1:1", "r1:1")
        pool.transfer_ok("p1:1", "r2:1")
    assert stalled.snapshot().healthy


def test_a_request_avoids_its_failed_pair_while_another_worker_can_take_it():
    """``avoiding``: the workers of a request's failed transfer are passed over while another
    can take the call, and picked again when none can (a preference, not a refusal)."""
    workers = [d("a", 0), d("b", 50)]
    pick = lambda excluded: pick_decode(workers, 1, excluded)  # noqa: E731
    assert pick(frozenset()).worker_id == "a"
    assert avoiding(pick, frozenset(), {"a"}).worker_id == "b"
    assert avoiding(pick, frozenset({"b"}), {"a"}).worker_id == "a"  # nothing else is left
    assert avoiding(pick, frozenset({"a", "b"}), {"a"}).worker_id is None
