"""Event ordering and the use of the real routing and autoscaling policies in the simulator."""

import dataclasses
import math

import numpy as np
import pytest

from pdserve.cluster.autoscaling import pool_config
from pdserve.planner.autoscale import AutoscaleDriver
from pdserve.planner.metrics import SimResult, Slo, weighted_percentiles
from pdserve.planner.layout import Layout
from pdserve.planner.worker import EngineLimits
from tests.planner.helpers import DEVICE, cost, requests, simulate


def test_one_request_on_an_idle_disaggregated_cluster_takes_exactly_the_modelled_times():
    c = cost()
    r = simulate(Layout(prefill=1, decode=1), requests((1.0, 100, 5)))
    prefill = c.prefill_s([(100, 0)])
    assert r.first_token[0] == pytest.approx(1.0 + prefill)
    # transfer, then 4 decode steps at contexts 101..104
    decode = sum(c.decode_s(1, 101 + i) for i in range(4))
    # one epoch of 4 steps uses the mid-epoch context for all of them
    epoch = 4 * c.decode_s(1, 101 + 1.5)
    assert r.finish[0] == pytest.approx(1.0 + prefill + c.transfer_s(100) + epoch)
    assert epoch == pytest.approx(decode)
    assert r.output_tokens[0] == 5 and r.failed == 0


def test_colocated_request_decodes_on_the_worker_that_prefilled_it():
    c = cost()
    r = simulate(Layout(colocated=1), requests((0.0, 100, 3)))
    assert r.first_token[0] == pytest.approx(c.prefill_s([(100, 0)]))
    assert r.finish[0] - r.first_token[0] == pytest.approx(2 * c.decode_s(1, 101.5))


def test_a_sequence_whose_kv_arrives_mid_epoch_runs_every_one_of_its_steps():
    # A decodes a long epoch; B's long prompt ends while that epoch runs, so B's KV arrives
    # mid-epoch. B joins at the next step boundary and then runs its 19 steps; it must not be
    # counted in the epoch's steps that ran before it arrived.
    c = cost()
    r = simulate(Layout(prefill=1, decode=1), requests((0.0, 100, 400), (0.0, 2000, 20)))
    kv_here = r.first_token[1] + c.transfer_s(2000)
    assert kv_here < r.finish[0]  # it did arrive while A was decoding
    one_step_at_least = c.decode_s(1, 101)
    one_step_at_most = c.decode_s(2, 2 * 2500)
    assert r.finish[1] - kv_here >= 19 * one_step_at_least
    assert r.finish[1] - kv_here <= 20 * one_step_at_most  # at most one step's wait for the boundary


def test_a_closed_loop_sends_each_request_when_a_client_is_free():
    c = cost()
    reqs = requests(*[(99.0, 100, 3)] * 5)  # the trace's times do not count in a closed loop
    r = simulate(Layout(colocated=1), reqs, closed_loop=2)
    assert r.completed == 5 and r.failed == 0
    assert list(r.arrival[:2]) == [0.0, 0.0]
    # each later request is sent the moment an earlier one finishes: by a client that is free
    finishes = sorted(r.finish)
    assert list(r.arrival[2:]) == finishes[:3]
    # never more than 2 in flight
    for t in r.arrival:
        assert ((r.arrival <= t) & (r.finish > t)).sum() <= 2
    # TTFT counts from the send, not from the trace's time
    assert r.first_token[0] == pytest.approx(c.prefill_s([(100, 0)]))
    assert np.nanmin(r.first_token - r.arrival) > 0


def test_a_closed_loop_of_one_runs_the_requests_back_to_back():
    r = simulate(Layout(prefill=1, decode=1), requests(*[(0.0, 200, 4)] * 3), closed_loop=1)
    assert r.arrival[1] == pytest.approx(r.finish[0]) and r.arrival[2] == pytest.approx(r.finish[1])
    assert r.ttft[0] == pytest.approx(r.ttft[1]) == pytest.approx(r.ttft[2])  # same work, idle cluster each time


def test_events_keep_causal_order_under_load():
    rng = np.random.default_rng(0)
    reqs = requests(*[(float(t), int(p), int(o)) for t, p, o in
                      zip(np.sort(rng.uniform(0, 5, 300)), rng.integers(1, 900, 300), rng.integers(1, 80, 300))])
    for layout in (Layout(prefill=2, decode=1), Layout(colocated=2)):
        r = simulate(layout, reqs, EngineLimits(max_num_seqs=16, max_num_batched_tokens=512))
        assert r.completed == len(reqs)
        assert (r.first_token >= r.arrival).all() and (r.finish >= r.first_token).all()


def test_the_router_policy_spreads_simultaneous_prompts_over_prefill_workers():
    reqs = requests((0.0, 1000, 2), (0.0, 1000, 2))
    one = simulate(Layout(prefill=1, decode=1), reqs, EngineLimits(max_num_batched_tokens=1000))
    two = simulate(Layout(prefill=2, decode=1), reqs, EngineLimits(max_num_batched_tokens=1000))
    assert one.first_token[1] > one.first_token[0]  # queued behind the first on the only worker
    assert two.first_token[1] == two.first_token[0]  # least queued tokens: the idle worker took it


def test_a_full_router_queue_fails_requests_after_the_admission_wait():
    reqs = requests(*[(0.0, 4000, 2)] * 6)
    r = simulate(Layout(prefill=1, decode=1), reqs, max_queued_tokens=8000, admission_wait_s=0.0)
    assert r.failed > 0 and r.completed == len(reqs) - r.failed


def test_a_burst_scales_the_prefill_pool_up_and_then_down():
    fast = dict(window_s=3.0, scale_up_cooldown_s=1.0, scale_down_cooldown_s=5.0, max_sample_age_s=5.0)
    configs = {"prefill": pool_config("prefill", target=2000.0, slo_s=100.0, max_replicas=3, **fast),
               "decode": pool_config("decode", target=0.7, slo_s=100.0, **fast)}
    burst = [(10.0 + i * 0.02, 4000, 2) for i in range(300)]  # 50 prompts/s, a worker does ~20
    quiet = [(40.0 + i, 10, 2) for i in range(60)]
    driver = AutoscaleDriver(configs)
    r = simulate(Layout(prefill=1, decode=1), requests(*burst, *quiet), autoscaler=driver, startup_s=2.0)
    replicas = [n for _, n, _, _ in r.pool_history["prefill"]]
    assert max(replicas) > 1 and replicas[-1] == 1
    assert r.completed == 360
    assert max(n for _, n, _, _ in r.pool_history["decode"]) == 1


def test_goodput_counts_requests_meeting_both_slos():
    r = SimResult(arrival=np.zeros(4), first_token=np.array([0.1, 0.5, 0.1, np.nan]),
                  finish=np.array([1.1, 1.5, 5.1, np.nan]), output_tokens=np.array([11, 11, 11, 11]),
                  itl_values=np.array([0.1]), itl_weights=np.array([1]), duration_s=2.0, gpus=2)
    slo = Slo(ttft_s=0.2, tpot_s=0.2)
    assert r.attainment(slo) == 0.25  # only the first: the second is late, the third slow, the fourth failed
    assert r.goodput_rps(slo) == 0.5
    assert r.percentiles()["tpot_s"]["p50"] == pytest.approx(0.1)


def test_weighted_percentiles():
    p = weighted_percentiles(np.array([3.0, 1.0, 2.0]), np.array([1, 98, 1]))
    assert p["p50"] == 1.0 and p["p99"] == 2.0
    assert math.isnan(weighted_percentiles(np.array([]), np.array([]))["p50"])


def test_first_crossing_interpolates_where_the_curve_falls_through_the_target():
    from pdserve.planner.metrics import first_crossing

    assert first_crossing([1, 2, 3], [0.99, 0.95, 0.85], 0.9) == pytest.approx(2.5)
    assert first_crossing([1.6, 1.0, 0.4], [1.0, 0.95, 0.75], 0.9) == pytest.approx(1.0 - 0.6 * 0.25)
    assert first_crossing([1, 2], [0.95, 0.92], 0.9) is None


def test_prefill_workers_take_their_own_limits():
    # a prefill budget of 100 tokens chunks a 250-token prompt into three steps; decode keeps the default
    c = cost()
    r = simulate(Layout(prefill=1, decode=1), requests((0.0, 250, 2)), EngineLimits(),
                 prefill_limits=EngineLimits(max_num_batched_tokens=100))
    chunks = c.prefill_s([(100, 0)]) + c.prefill_s([(100, 100)]) + c.prefill_s([(50, 200)])  # each step samples one row
    assert r.first_token[0] == pytest.approx(chunks)


def test_without_chunking_a_colocated_prefill_stalls_every_running_stream():
    # vLLM before chunked prefill: a step is whole prompts or decodes, prefill first. Request 0
    # decodes alone until request 1 arrives; its whole 1000-token prefill is a gap in request
    # 0's tokens, so request 0's TPOT carries it.
    c = cost()
    lim = EngineLimits(max_num_batched_tokens=16384, enable_chunked_prefill=False)
    alone = simulate(Layout(colocated=1), requests((0.0, 100, 50)), lim)
    both = simulate(Layout(colocated=1), requests((0.0, 100, 50), (0.05, 1000, 2)), lim)
    stall = c.prefill_s([(1000, 0)])
    assert both.finish[0] - alone.finish[0] >= stall
    assert both.tpot[0] - alone.tpot[0] >= stall / 49


def lending(prefill: float, decode: float):
    """The test device as a CPU host whose idle workers lend their cores (``borrow_*_factor``)."""
    return dataclasses.replace(DEVICE, borrow_prefill_factor=prefill, borrow_decode_factor=decode)


def test_a_step_runs_at_the_borrowed_speed_only_while_every_other_worker_idles():
    """A CPU profile's borrowed cores (``borrow_*_factor``): a lone request's prefill and decode
    run at the borrowed speed (the other worker idles throughout); a second prompt arriving
    mid-decode ends the borrowed epoch after its step, and the decode steps that overlap the
    prefill run at the worker's own speed."""
    hw = lending(0.5, 0.6)
    c = cost(hw=hw)
    alone = simulate(Layout(prefill=1, decode=1), requests((0.0, 100, 5)), hw=hw)
    prefill = 0.5 * c.prefill_s([(100, 0)])
    assert alone.first_token[0] == pytest.approx(prefill)
    assert alone.finish[0] == pytest.approx(prefill + c.transfer_s(100) + 4 * 0.6 * c.decode_s(1, 101 + 1.5))
    # a long answer, and a prompt that arrives during its third decode step
    start = prefill + c.transfer_s(100)
    step = 0.6 * c.decode_s(1, 101 + 98 / 2)  # the epoch runs to the first finish: 99 steps
    second = start + 2.5 * step
    both = simulate(Layout(prefill=1, decode=1), requests((0.0, 100, 100), (second, 100, 2)), hw=hw)
    long = simulate(Layout(prefill=1, decode=1), requests((0.0, 100, 100)), hw=hw)
    busy = c.prefill_s([(100, 0)])
    assert both.first_token[1] == pytest.approx(second + busy)  # the decode worker is busy: no borrowing
    # While that prompt computes, the long answer's steps take their own time, not 0.6 of it:
    # it ends at least 0.4 of the prefill later than alone (the second stream's steps add more)
    assert both.finish[0] - long.finish[0] >= 0.4 * busy * 0.99


def test_a_borrowed_prefill_step_goes_on_at_its_own_speed_once_another_worker_starts():
    """Two prompts on two idle prefill workers, the second 1 ms after the first: the first
    starts on the borrowed cores (half its time) and computes the rest of its step at its own
    speed from the moment the second starts, which never borrows."""
    hw = lending(0.5, 0.5)
    own, gap = cost(hw=hw).prefill_s([(1000, 0)]), 1e-3
    r = simulate(Layout(prefill=2, decode=1), requests((0.0, 1000, 1), (gap, 1000, 1)), hw=hw)
    assert gap < 0.5 * own
    assert r.first_token[0] == pytest.approx(gap + (0.5 * own - gap) / 0.5)  # = own - gap
    assert r.first_token[1] == pytest.approx(gap + own)
