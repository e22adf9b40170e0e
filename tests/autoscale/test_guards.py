"""The guards every policy runs behind: full window, staleness, pending change, settling,
bounds, step and cooldowns. Prefill's defaults serve as the example pool."""

import pytest

from pdserve.cluster.autoscaling import MetricsError, MetricsWindow, ScalerState, decide, pool_config
from tests.autoscale.helpers import steady_window

CFG = pool_config("prefill")  # window 20 s, up cooldown 10 s, down cooldown 60 s, 1..4 replicas
HIGH = 3 * 4096  # queued prompt tokens per worker: 3x target


def high(replicas, now=100.0, span_s=20.0, **kw):
    return steady_window(replicas, now, span_s, queued_prompt_tokens=HIGH * replicas, **kw)


def test_no_samples_holds():
    d = decide("prefill", MetricsWindow(()), CFG, ScalerState(desired=2), now=5.0)
    assert (d.action, d.desired) == ("hold", 2) and "no samples" in d.reason


def test_cold_start_partial_window_holds_then_acts_once_full():
    partial = decide("prefill", high(1, span_s=12.0), CFG, ScalerState(), now=100.0)
    assert partial.action == "hold" and "cold start" in partial.reason
    assert partial.proposed > 1  # the policy wanted more; the guard held it, and says so
    full = decide("prefill", high(1, span_s=20.0), CFG, ScalerState(), now=100.0)
    assert (full.action, full.desired) == ("up", 2)


def test_stale_latest_sample_holds():
    d = decide("prefill", high(1, now=90.0), CFG, ScalerState(), now=100.0)
    assert d.action == "hold" and "stale" in d.reason and "max_sample_age_s" in d.reason


def test_sample_from_the_future_is_an_error():
    with pytest.raises(MetricsError, match="must be <= now"):
        decide("prefill", high(1, now=101.0), CFG, ScalerState(), now=100.0)


def test_pending_change_blocks_decisions():
    state = ScalerState(desired=3, last_scale_up_t=50.0)
    d = decide("prefill", high(2), CFG, state, now=100.0)
    assert d.action == "hold" and "pending" in d.reason and "2 replicas ready of 3" in d.reason


def test_pending_also_blocks_the_bound_correction():
    state = ScalerState(desired=2, last_scale_up_t=50.0)
    d = decide("prefill", steady_window(0, 100.0, 20.0), CFG, state, now=100.0)
    assert d.action == "hold" and "pending" in d.reason


def test_window_must_be_settled_after_the_last_change():
    state = ScalerState(desired=2, last_scale_up_t=90.0)
    mixed = MetricsWindow(high(1, now=90.0, span_s=10.0).samples + high(2, now=100.0, span_s=9.0).samples)
    d = decide("prefill", mixed, CFG, state, now=100.0)
    assert d.action == "hold" and "settling" in d.reason
    # All samples show 2 replicas, but some predate the decision: still settling.
    early = decide("prefill", high(2, now=100.0), CFG, state, now=100.0)
    assert early.action == "hold" and "settling" in early.reason
    later = decide("prefill", high(2, now=125.0), CFG, state, now=125.0)
    assert (later.action, later.desired) == ("up", 3)


def test_below_min_goes_straight_to_min_even_on_a_cold_window():
    cfg = pool_config("prefill", min_replicas=3)
    d = decide("prefill", steady_window(1, 100.0, 2.0), cfg, ScalerState(), now=100.0)
    assert (d.action, d.desired) == ("up", 3) and "min_replicas 3" in d.reason


def test_above_max_goes_straight_to_max():
    d = decide("prefill", high(7), CFG, ScalerState(), now=100.0)
    assert (d.action, d.desired) == ("down", 4) and "max_replicas 4" in d.reason


def test_clamped_at_max_under_load_and_at_min_when_idle():
    at_max = decide("prefill", high(4), CFG, ScalerState(), now=100.0)
    assert at_max.action == "hold" and "at max_replicas 4" in at_max.reason and at_max.proposed > 4
    idle = decide("prefill", steady_window(1, 100.0, 20.0), CFG, ScalerState(), now=100.0)
    assert idle.action == "hold" and "at min_replicas 1" in idle.reason


@pytest.mark.parametrize("step, replicas, expect", [(1, 1, 2), (2, 1, 3), (8, 1, 3), (8, 2, 6)])
def test_step_caps_a_proportional_change(step, replicas, expect):
    # 3x the target per worker: the policy asks for 3x the replicas; step and max=6 cap it.
    cfg = pool_config("prefill", step=step, max_replicas=6)
    d = decide("prefill", high(replicas), cfg, ScalerState(), now=100.0)
    assert (d.desired, d.proposed) == (expect, 3 * replicas)
    assert ("limited" in d.reason) == (expect != 3 * replicas)


def test_up_cooldown_counts_from_any_change():
    cfg = pool_config("prefill", window_s=5.0, scale_up_cooldown_s=30.0)
    state = ScalerState(desired=2, last_scale_down_t=80.0)
    held = decide("prefill", high(2, span_s=5.0), cfg, state, now=100.0)
    assert held.action == "hold" and "scale_up_cooldown_s 30.0, 20.0 s since" in held.reason
    assert decide("prefill", high(2, now=110.0, span_s=5.0), cfg, state, now=110.0).action == "up"


def test_down_cooldown_is_the_longer_one_and_counts_from_a_scale_up():
    state = ScalerState(desired=3, last_scale_up_t=100.0)
    idle = lambda now: steady_window(3, now, 20.0)  # noqa: E731
    held = decide("prefill", idle(130.0), CFG, state, now=130.0)
    assert held.action == "hold" and "scale_down_cooldown_s 60.0" in held.reason and held.proposed < 3
    down = decide("prefill", idle(160.0), CFG, state, now=160.0)
    assert (down.action, down.desired) == ("down", 2)


def test_decision_carries_its_inputs():
    d = decide("prefill", high(2, ttft_p90_s=1.0), CFG, ScalerState(), now=100.0)
    row = d.as_dict()
    assert row["pool"] == "prefill" and row["action"] == "up" and row["current"] == 2 and row["desired"] == 3
    assert row["samples"] == 21 and row["window_span_s"] == 20.0
    assert row["queued_prompt_tokens_per_worker_mean"] == HIGH and row["queued_prompt_tokens_per_worker_target"] == 4096
    assert row["ttft_p90_s_mean"] == 1.0 and row["ttft_p90_s_target"] == 2.0
