"""Decode over simulated time: KV usage and ITL against the SLO."""

import random

from pdserve.cluster.autoscaling import ScalerState, decide, pool_config
from tests.autoscale.helpers import decode_load, simulate, steady_window

CFG = pool_config("decode")  # target 0.7 of KV, ITL SLO 0.2 s


def test_kv_at_target_holds():
    run = simulate("decode", CFG, decode_load(lambda t: 2 * 0.7), 600, start_replicas=2)
    assert run.changes == [] and run.final_replicas == 2


def test_kv_pressure_scales_up_until_usage_is_back_in_the_band():
    run = simulate("decode", CFG, decode_load(lambda t: 2.0), 600)  # two full caches of streams
    assert [d.action for _, d in run.changes] == ["up", "up"]
    assert run.final_replicas == 3  # 2.0 / 3 = 0.67 of KV per worker: inside the band


def test_itl_slo_breach_alone_scales_up():
    window = steady_window(2, 100.0, 20.0, kv_usage=0.5, itl_p90_s=0.3)
    d = decide("decode", window, CFG, ScalerState(), now=100.0)
    assert (d.action, d.desired) == ("up", 3) and "itl_p90_s" in d.reason and "kv_usage" not in d.reason


def test_scale_down_needs_kv_and_itl_both_low():
    kv_low_itl_mid = steady_window(2, 100.0, 20.0, kv_usage=0.1, itl_p90_s=0.15)
    kv_mid_itl_low = steady_window(2, 100.0, 20.0, kv_usage=0.5, itl_p90_s=0.02)
    both_low = steady_window(2, 100.0, 20.0, kv_usage=0.1, itl_p90_s=0.02)
    assert decide("decode", kv_low_itl_mid, CFG, ScalerState(), 100.0).action == "hold"
    assert decide("decode", kv_mid_itl_low, CFG, ScalerState(), 100.0).action == "hold"
    assert decide("decode", both_low, CFG, ScalerState(), 100.0).action == "down"


def test_idle_pool_with_no_streams_shrinks_to_min():
    run = simulate("decode", CFG, decode_load(lambda t: 0.0), 400, start_replicas=4)
    downs = [t for t, d in run.changes]
    assert run.final_replicas == 1 and len(downs) == 3
    assert all(b - a >= CFG.scale_down_cooldown_s for a, b in zip(downs, downs[1:]))


def test_noisy_kv_and_itl_around_target_never_change_replicas():
    rng = random.Random(7)
    kv = {t: 3 * 0.7 * rng.uniform(0.7, 1.3) for t in range(3601)}
    itl = {t: rng.uniform(0.08, 0.26) for t in range(3601)}  # single samples above 1.2x the SLO
    run = simulate("decode", CFG, decode_load(kv.__getitem__, itl.__getitem__), 3600, start_replicas=3)
    assert sum(v > 0.24 for v in itl.values()) > 100
    assert run.changes == []
