"""The routing policy: pure functions over worker snapshots."""

from pdserve.router.policy import WorkerSnapshot, pick_decode, pick_prefill


def p(wid, queued=0, healthy=True, draining=False, inflight=0):
    return WorkerSnapshot(wid, "prefill", healthy, draining, queued_tokens=queued, inflight=inflight)


def d(wid, used=0, total=100, healthy=True, draining=False, inflight=0):
    return WorkerSnapshot(wid, "decode", healthy, draining, blocks_used=used, blocks_total=total, inflight=inflight)


def test_prefill_goes_to_the_least_queued_tokens():
    assert pick_prefill([p("a", 500), p("b", 20), p("c", 300)]).worker_id == "b"


def test_prefill_ties_break_on_inflight_then_id():
    assert pick_prefill([p("b", 10, inflight=2), p("a", 10, inflight=2), p("c", 10, inflight=1)]).worker_id == "c"
    assert pick_prefill([p("b", 10), p("a", 10)]).worker_id == "a"


def test_equal_load_goes_to_the_worker_given_work_least_recently():
    never, recent, earlier = (WorkerSnapshot(w, "decode", True, blocks_total=100, last_placed=n)
                              for w, n in (("c", 0), ("a", 9), ("b", 4)))
    assert pick_decode([recent, earlier], blocks_needed=1).worker_id == "b"
    assert pick_decode([recent, earlier, never], blocks_needed=1).worker_id == "c"
    assert pick_prefill([WorkerSnapshot("a", "prefill", True, last_placed=3),
                         WorkerSnapshot("b", "prefill", True, last_placed=1)]).worker_id == "b"


def test_unhealthy_draining_and_excluded_prefill_workers_are_skipped():
    workers = [p("a", 0, healthy=False), p("b", 0, draining=True), p("c", 900), p("d", 5)]
    assert pick_prefill(workers, exclude=frozenset({"d"})).worker_id == "c"


def test_no_prefill_worker_says_why():
    choice = pick_prefill([p("a", healthy=False), d("x")])
    assert choice.worker_id is None and "prefill" in choice.reason


def test_decode_goes_to_the_least_used_fraction_of_kv():
    assert pick_decode([d("a", 50, 100), d("b", 60, 200), d("c", 10, 10)], blocks_needed=1).worker_id == "b"


def test_decode_skips_workers_that_cannot_fit_the_request():
    assert pick_decode([d("a", 95, 100), d("b", 97, 200)], blocks_needed=10).worker_id == "b"
    full = pick_decode([d("a", 95, 100)], blocks_needed=10)
    assert full.worker_id is None and "full" in full.reason


def test_decode_ignores_prefill_workers_and_the_excluded():
    assert pick_decode([p("a"), d("b", 90), d("c", 0)], 1, exclude=frozenset({"c"})).worker_id == "b"
    assert pick_decode([p("a")], 1).worker_id is None


def test_prefill_queues_past_the_limit_are_saturated():
    workers = [p("a", 900), p("b", 950)]
    assert pick_prefill(workers, prompt_tokens=100, max_queued_tokens=1000).worker_id == "a"
    full = pick_prefill(workers, prompt_tokens=200, max_queued_tokens=1000)
    assert full.worker_id is None and full.saturated and "queue is full" in full.reason


def test_decode_distinguishes_full_now_from_too_large_ever():
    busy = pick_decode([d("a", 95, 100)], blocks_needed=10)
    assert busy.saturated and not busy.too_large
    huge = pick_decode([d("a", 0, 100), d("b", 0, 120)], blocks_needed=500)
    assert huge.too_large and "120" in huge.reason


def test_a_limited_request_counts_unbounded_requests_blocks_as_room():
    """Issue 25: a decode worker full of requests without a limit is saturated for another
    such request, but a request with a limit may count their blocks as free: the decode
    engine preempts them first (pdserve/engine/core/scheduler.py, add_remote_prefilled)."""
    full = WorkerSnapshot("d0", "decode", True, blocks_used=100, blocks_total=100, blocks_unbounded=80)
    assert pick_decode([full], 10).saturated
    assert pick_decode([full], 10, limited=True).worker_id == "d0"
    assert pick_decode([full], 81, limited=True).saturated  # only the unbounded blocks count
