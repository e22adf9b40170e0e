"""Prefill over simulated time: queue per worker and TTFT against the SLO."""

import random

from pdserve.cluster.autoscaling import MetricsWindow, PoolSample, ScalerState, decide, pool_config
from tests.autoscale.helpers import prefill_load, simulate, steady_window

TARGET = 4096
# A short window and a long up cooldown so that the cooldown, not the window, paces the steps.
FAST = pool_config("prefill", window_s=5.0, scale_up_cooldown_s=30.0, scale_down_cooldown_s=60.0)


def test_steady_load_at_target_holds():
    run = simulate("prefill", pool_config("prefill"), prefill_load(lambda t: 2 * TARGET), 600, start_replicas=2)
    assert run.changes == [] and run.final_replicas == 2


def test_sustained_high_queue_steps_up_one_at_a_time_paced_by_the_cooldown():
    run = simulate("prefill", FAST, prefill_load(lambda t: 100 * TARGET), 200, startup_s=2.0)
    ups = [t for t, d in run.changes]
    assert [d.desired - d.current for _, d in run.changes] == [1, 1, 1]
    # First on the first full window; then each 30 s cooldown (not the 5 s window) sets the pace.
    assert ups == [5.0, 35.0, 65.0]
    assert run.final_replicas == 4  # max_replicas, then it holds
    assert "at max_replicas" in run.decisions[-1][1].reason


def test_ttft_slo_breach_alone_scales_up():
    slow = steady_window(2, 100.0, 20.0, queued_prompt_tokens=TARGET, ttft_p90_s=3.0)  # queue at 0.5x
    d = decide("prefill", slow, pool_config("prefill"), ScalerState(), now=100.0)
    assert (d.action, d.desired) == ("up", 3)
    assert "ttft_p90_s" in d.reason and "queued_prompt_tokens_per_worker" not in d.reason


def test_queue_alone_scales_up_with_no_latency_data():
    d = decide("prefill", steady_window(1, 100.0, 20.0, queued_prompt_tokens=2 * TARGET), pool_config("prefill"),
               ScalerState(), now=100.0)
    assert d.action == "up" and "queued_prompt_tokens_per_worker mean 8192 is 2.00x target 4096" in d.reason


def test_scale_down_needs_both_signals_comfortably_low():
    cfg = pool_config("prefill")
    queue_low_ttft_mid = steady_window(3, 100.0, 20.0, queued_prompt_tokens=0, ttft_p90_s=1.5)
    queue_mid_ttft_low = steady_window(3, 100.0, 20.0, queued_prompt_tokens=3 * 3000, ttft_p90_s=0.2)
    both_low = steady_window(3, 100.0, 20.0, queued_prompt_tokens=3 * 1000, ttft_p90_s=0.2)
    assert decide("prefill", queue_low_ttft_mid, cfg, ScalerState(), 100.0).action == "hold"
    assert decide("prefill", queue_mid_ttft_low, cfg, ScalerState(), 100.0).action == "hold"
    d = decide("prefill", both_low, cfg, ScalerState(), 100.0)
    assert (d.action, d.desired) == ("down", 2) and d.proposed == 1  # ceil(3 * 0.24); step 1 limits


def test_one_busy_sample_in_an_idle_window_blocks_scale_down():
    idle = steady_window(2, 100.0, 20.0, queued_prompt_tokens=0).samples
    busy = PoolSample(idle[10].t, 2, queued_prompt_tokens=int(2 * 0.8 * TARGET))  # 0.8x for one sample
    d = decide("prefill", MetricsWindow(idle[:10] + (busy,) + idle[11:]), pool_config("prefill"), ScalerState(), 100.0)
    assert d.action == "hold" and "within the band" in d.reason  # the mean is low, the peak is not


def test_scale_down_waits_for_the_longer_cooldown_after_load_stops():
    load = prefill_load(lambda t: 100 * TARGET if t < 40 else 0)
    run = simulate("prefill", FAST, load, 400, startup_s=2.0)
    ups = [t for t, d in run.changes if d.action == "up"]
    downs = [t for t, d in run.changes if d.action == "down"]
    assert ups == [5.0, 35.0] and len(downs) == 2  # up while loaded, then back to 1
    assert downs[0] - ups[-1] >= FAST.scale_down_cooldown_s
    assert all(b - a >= FAST.scale_down_cooldown_s for a, b in zip(downs, downs[1:]))
    assert run.final_replicas == 1


def test_noise_around_the_target_never_changes_replicas():
    rng = random.Random(4)
    # +-35% per sample: single samples cross the up threshold (1.2x), the window mean does not.
    queue = {t: int(2 * TARGET * rng.uniform(0.65, 1.35)) for t in range(3601)}
    ttft = {t: rng.uniform(0.8, 2.2) for t in range(3601)}  # around 1.5 s; single samples above 1.2x 2 s
    run = simulate("prefill", pool_config("prefill"), prefill_load(queue.__getitem__, ttft.__getitem__), 3600,
                   start_replicas=2)
    assert sum(q > 1.2 * 2 * TARGET for q in queue.values()) > 100  # the noise does cross the band
    assert len(run.decisions) == 3601 and run.changes == []


def test_slow_square_wave_is_followed_no_faster_than_the_cooldowns_allow():
    cfg = pool_config("prefill")
    wave = prefill_load(lambda t: 6 * TARGET if (t // 45) % 2 == 0 else 0)  # 45 s on, 45 s off
    run = simulate("prefill", cfg, wave, 1800, startup_s=5.0)
    changes = run.changes
    assert any(d.action == "up" for _, d in changes) and any(d.action == "down" for _, d in changes)
    for (t_prev, prev), (t, d) in zip(changes, changes[1:]):
        cooldown = cfg.scale_up_cooldown_s if d.action == "up" else cfg.scale_down_cooldown_s
        assert t - t_prev >= max(cooldown, cfg.window_s), (t_prev, prev.action, t, d.action)
    # The fastest possible cycle is up, 60 s down cooldown, down, a fresh 20 s window, up.
    reversals = sum(a.action != b.action for (_, a), (_, b) in zip(changes, changes[1:]))
    assert reversals <= 2 * 1800 / (cfg.scale_down_cooldown_s + cfg.window_s)


def test_fast_square_wave_never_scales_down():
    # 15 s on, 15 s off: every 20 s window holds a busy sample, so no window is "comfortably low".
    cfg = pool_config("prefill")
    run = simulate("prefill", cfg, prefill_load(lambda t: 6 * TARGET if (t // 15) % 2 == 0 else 0), 1800)
    assert {d.action for _, d in run.changes} == {"up"} and run.final_replicas == cfg.max_replicas
