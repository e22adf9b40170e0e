"""Prefill that keeps up (pdserve/router/local_prefill.py, ``PREFILL_BEHIND``): the rule on
plain values, the pace it predicts with, and the router's plan taking it."""

import pytest

from pdserve.engine.config import MIXED
from pdserve.protos import worker_pb2
from pdserve.router.local_prefill import (LocalPrefillConfig, Mixed, PrefillPace, Reason, decide,
                                          decide_for_attempt)
from pdserve.router.kv_policy import RoutingConfig
from pdserve.router.pool import WorkerClient
from pdserve.router.request_run import _mixed
from pdserve.shell.stats import local_prefill_token_s
from tests.helpers.scheduler import make

ON = LocalPrefillConfig(overflow_ttft_s=1.0, overflow_slowdown=2.0)


def plan(config=ON, prompt=256, load=0.1, prefill_queue=0, own_queue=0, token_s=0.001, local_token_s=None):
    return decide(config, prompt, load, mixed=Mixed(own_queue=own_queue, prefill_queue=prefill_queue, token_s=token_s,
                                                    local_token_s=local_token_s))


def test_a_prompt_goes_to_the_prefill_pool_while_its_queue_keeps_within_the_budget():
    # (744 + 256) tokens x 1 ms = 1.0 s: not past the budget
    assert plan(prefill_queue=744).reason is Reason.OFF


def test_a_prompt_the_prefill_pool_would_start_too_late_is_prefilled_by_its_decode_worker():
    # remote (745 + 256) x 1 ms = 1.001 s > 1 s; local 256 x 2 ms = 0.512 s
    d = plan(prefill_queue=745)
    assert d.local and d.reason is Reason.PREFILL_BEHIND and d.uncached_tokens == 256


def test_a_decode_worker_behind_as_well_leaves_it_to_the_prefill_pool():
    # remote (2000 + 256) x 1 ms = 2.256 s; local (900 + 256) x 2 ms = 2.312 s: not sooner
    assert plan(prefill_queue=2000, own_queue=900).reason is Reason.OFF
    assert plan(prefill_queue=2000, own_queue=800).reason is Reason.PREFILL_BEHIND  # 2.112 s: sooner


def test_the_slowdown_weighs_a_decode_workers_tokens():
    slow = LocalPrefillConfig(overflow_ttft_s=1.0, overflow_slowdown=5.0)
    assert plan(slow, prefill_queue=1000).reason is Reason.OFF  # local 1.28 s > remote 1.256 s
    assert plan(slow, prefill_queue=1100).reason is Reason.PREFILL_BEHIND  # 1.356 s


def test_the_decode_workers_measured_cost_replaces_the_slowdown():
    """remote (1100 + 256) x 1 ms = 1.356 s. With 500 tokens queued on the decode worker, the
    constant 2 says local (756 x 2 ms) = 1.512 s, later; its measured 1.3 ms says 0.983 s, sooner."""
    assert plan(prefill_queue=1100, own_queue=500).reason is Reason.OFF
    assert plan(prefill_queue=1100, own_queue=500, local_token_s=0.0013).reason is Reason.PREFILL_BEHIND


def test_a_decode_worker_measured_slower_than_the_slowdown_leaves_it_to_the_prefill_pool():
    # remote (745 + 256) x 1 ms = 1.001 s; local 256 x 2 ms = 0.512 s, but 256 x 4 ms = 1.024 s
    assert plan(prefill_queue=745).reason is Reason.PREFILL_BEHIND
    assert plan(prefill_queue=745, local_token_s=0.004).reason is Reason.OFF


def test_a_measured_cost_does_not_stand_for_the_prefill_pools_pace():
    assert plan(prefill_queue=10**6, token_s=None, local_token_s=0.0013).reason is Reason.OFF


def test_a_decode_workers_measured_cost_travels_from_its_scheduler_to_the_rule():
    """Its step budget's timings -> its WorkerStats, over the wire -> the router's snapshot ->
    the rule's ``Mixed``; unmeasured, the field stays 0 and the rule falls back."""
    sched, _ = make(policy=MIXED, mixed_step_target_s=0.05)
    client = WorkerClient("decode", "d", channel=None, stub=None)
    client.healthy = True

    def reported() -> float | None:
        stats = worker_pb2.WorkerStats(local_prefill_token_s=local_prefill_token_s(sched))
        client.stats = worker_pb2.WorkerStats.FromString(stats.SerializeToString())
        snapshot = client.snapshot()
        return _mixed([snapshot], snapshot, 0.001).local_token_s

    assert reported() is None
    sched.step_budget.observe(4, 0, 0.017)  # a 17 ms decode step; 1.3 ms a prompt token: a 25-token chunk
    sched.step_budget.observe(4, 100, 0.017 + 100 * 0.0013)
    assert reported() == pytest.approx(0.017 / 25 + 0.0013)  # the whole step over its 25 tokens
    assert local_prefill_token_s(make(mixed_step_target_s=0.05)[0]) == 0.0  # a prefill worker's: no budget


def test_off_unknown_pace_or_no_prefill_worker_never_overflows():
    assert plan(LocalPrefillConfig(), prefill_queue=10**6).reason is Reason.OFF  # off unless set
    assert plan(prefill_queue=10**6, token_s=None).reason is Reason.OFF  # no prefill answer seen yet
    assert plan(prefill_queue=None).reason is Reason.OFF  # nothing to be behind


def test_the_other_rules_come_first():
    colocated = LocalPrefillConfig(colocated=True, overflow_ttft_s=1.0)
    assert plan(colocated, prefill_queue=10**6).reason is Reason.COLOCATED
    mixed = decide(ON, 256, 0.1, mixed=Mixed(worker=True, own_queue=10**6, prefill_queue=10, token_s=0.001))
    assert mixed.reason is Reason.PREFILL_SHORTER  # a mixed worker's own rule


def test_a_conversations_holder_is_planned_by_its_costs_not_the_overflow():
    """With a decode worker caching more than the prefill pool, the plans of decode KV reuse
    decide, as before."""
    from pdserve.router.local_prefill import DecodeHolder, PrefillOption

    holder = DecodeHolder("d", cached_tokens=200, load=0.1)
    d = decide_for_attempt(ON, RoutingConfig(), 256, 0.1, holder, [PrefillOption(0, 10**5)],
                           mixed=Mixed(prefill_queue=10**5, token_s=0.001))
    assert d.reason is Reason.DECODE_HIT


def test_the_pace_is_a_weighted_mean_of_compute_seconds_per_token():
    pace = PrefillPace(weight=0.5, min_tokens=32)
    assert pace.token_s is None
    pace.observe(256, 0.256)
    assert pace.token_s == pytest.approx(0.001)
    pace.observe(128, 0.384)  # 3 ms
    assert pace.token_s == pytest.approx(0.002)
    for tokens, seconds in ((31, 9.0), (256, 0.0), (256, -1.0), (256, float("inf"))):
        pace.observe(tokens, seconds)  # too short to say, or no time at all
    assert pace.token_s == pytest.approx(0.002)


@pytest.mark.parametrize("kw, name", [({"overflow_ttft_s": -1}, "overflow_ttft_s"),
                                      ({"overflow_slowdown": 0.5}, "overflow_slowdown")])
def test_impossible_overflow_settings_are_refused_by_name(kw, name):
    with pytest.raises(ValueError, match=name):
        LocalPrefillConfig(**kw)
