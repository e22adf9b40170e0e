"""The router's recent latencies: an exact p90 over a trailing window, and what
RouterAdmin.GetLatency gives the autoscaler after real traffic through the router's logic."""

import asyncio
import time

import pytest

from pdserve.protos import admin_pb2
from pdserve.router.admin import RouterAdminService
from tests.metrics.metrics_helpers import FakeClock, FakeDecode, FakePrefill, fake_pool, request_run
from pdserve.wire.latency import RecentLatencies


def test_p90_is_the_nearest_rank_of_the_windows_observations():
    clock = FakeClock()
    recent = RecentLatencies(clock=clock)
    for v in [5.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]:  # 5.0 comes first, then ages out
        recent.add(v)
        clock.advance(1.0)
    assert recent.quantile(0.9, window_s=100) == (0.9, 10)  # rank ceil(0.9 * 10) = 9 of 10
    assert recent.quantile(1.0, window_s=100) == (5.0, 10)
    assert recent.quantile(1.0, window_s=9.5) == (0.9, 9)  # 5.0 is outside the window
    assert recent.quantile(0.5, window_s=9.5) == (0.5, 9)
    assert recent.quantile(0.9, window_s=2.5) == (0.9, 2)


def test_no_observation_in_the_window_is_no_evidence_not_zero():
    clock = FakeClock()
    recent = RecentLatencies(clock=clock)
    assert recent.quantile(0.9, 10) == (None, 0)
    recent.add(0.5)
    clock.advance(11)
    assert recent.quantile(0.9, 10) == (None, 0)


def test_observations_older_than_the_horizon_are_dropped():
    clock = FakeClock()
    recent = RecentLatencies(horizon_s=60, clock=clock)
    recent.add(1.0)
    clock.advance(61)
    recent.add(2.0)
    assert len(recent._obs) == 1 and recent.quantile(0.9, 1e9) == (2.0, 1)


def test_a_bad_quantile_names_q():
    with pytest.raises(ValueError, match="q"):
        RecentLatencies().quantile(0.0, 10)


def test_get_latency_reports_the_ttft_and_itl_of_requests_just_served():
    pool = fake_pool([FakePrefill()], [FakeDecode(token_s=0.05)])
    service = RouterAdminService(pool)

    async def main():
        started = time.monotonic()
        for _ in range(3):
            async for _resp in request_run(pool, max_tokens=5).responses():
                pass
        # The recent latencies are the process's own, shared with every test before this one:
        # a window of this test's traffic only (a 60 s window once took in other tests' 0 ms ITLs).
        window_s = time.monotonic() - started
        return await service.GetLatency(admin_pb2.LatencyRequest(window_s=window_s), None)

    got = asyncio.run(main())
    assert got.HasField("ttft_p90_s") and got.HasField("itl_p90_s")
    assert got.ttft_count == 3 and got.itl_count == 3 * 4  # 4 token batches after each first token
    assert got.itl_p90_s >= 0.05  # each fake token took 50 ms
    quiet = asyncio.run(service.GetLatency(admin_pb2.LatencyRequest(window_s=1e-6), None))
    assert not quiet.HasField("ttft_p90_s") and not quiet.HasField("itl_p90_s")
