"""The budget policy (pdserve/cluster/autoscaling/budget.py): with a fixed number of elastic
workers, which pool gives one to which, and the guards that keep it from flapping."""

from __future__ import annotations

import pytest

from pdserve.cluster.autoscaling import pool_config
from pdserve.cluster.autoscaling.budget import BudgetConfig, BudgetConfigError, decide_roles, pressure
from tests.autoscale.helpers import steady_window

TARGETS = {"prefill": pool_config("prefill"), "decode": pool_config("decode")}  # 4096 tokens/worker, TTFT 2 s; KV 0.7, ITL 0.2 s
CFG = BudgetConfig()  # high 1.0, low 0.7, window 10 s, dwell 15 s
WHOLE = BudgetConfig(mixed=False)  # whole moves only: the holds below would otherwise be half moves
NOW = 100.0


def windows(prefill: int, decode: int, span_s: float = 10.0, now: float = NOW, *, queued: int = 0,
            ttft: float | None = None, kv: float = 0.0, itl: float | None = None) -> dict:
    return {"prefill": steady_window(prefill, now, span_s, queued_prompt_tokens=queued, ttft_p90_s=ttft),
            "decode": steady_window(decode, now, span_s, kv_usage=kv, itl_p90_s=itl)}


def test_a_long_prompt_backlog_takes_a_worker_from_an_idle_decode_pool():
    move = decide_roles(windows(1, 3, queued=8192, kv=0.1), TARGETS, CFG, None, NOW)  # 2x prefill's target
    assert (move.donor, move.taker, move.label) == ("decode", "prefill", "prefill_pressure")
    assert "queued_prompt_tokens_per_worker" in move.reason


def test_slow_tokens_take_a_worker_from_an_idle_prefill_pool():
    move = decide_roles(windows(3, 1, itl=0.3, kv=0.2), TARGETS, CFG, None, NOW)  # ITL 1.5x its SLO
    assert (move.donor, move.taker) == ("prefill", "decode")
    assert "itl_p90_s" in move.reason


def test_no_move_within_the_band_or_when_both_pools_are_hot():
    calm = decide_roles(windows(2, 2, queued=4000, kv=0.5), TARGETS, CFG, None, NOW)  # both under their targets
    assert calm.taker is None and "at or below high" in calm.reason
    both = decide_roles(windows(2, 2, queued=20000, kv=0.9), TARGETS, CFG, None, NOW)
    assert both.taker is None and "nothing to move" in both.reason


def test_the_donor_must_stay_comfortable_after_the_move():
    # decode at 0.4 of its KV target over 2 workers would be 0.8 over 1: above low (0.7), so no move
    move = decide_roles(windows(1, 2, queued=8192, kv=0.28), TARGETS, WHOLE, None, NOW)
    assert move.taker is None and "would be 0.80 >= low 0.7" in move.reason
    half = decide_roles(windows(1, 2, queued=8192, kv=0.28), TARGETS, CFG, None, NOW)  # 0.4 as it is: < low
    assert (half.source, half.target) == ("decode", "mixed") and "would be 0.80 >= low 0.7" in half.reason
    ok = decide_roles(windows(1, 2, queued=8192, kv=0.21), TARGETS, CFG, None, NOW)  # 0.3 -> 0.6 over 1
    assert ok.taker == "prefill"


def test_a_donors_latency_is_not_spread_over_fewer_workers_but_must_be_low_itself():
    # decode: ITL p90 at half its SLO over 2 workers gives one up (one fewer streams' worth of
    # weights to read per step, not twice the latency); at 0.8 of its SLO it does not
    ok = decide_roles(windows(1, 2, queued=8192, kv=0.05, itl=0.1), TARGETS, CFG, None, NOW)
    assert ok.taker == "prefill", ok.reason
    held = decide_roles(windows(1, 2, queued=8192, kv=0.05, itl=0.16), TARGETS, WHOLE, None, NOW)
    assert held.taker is None and "would be 0.80 >= low 0.7" in held.reason


def test_the_donor_keeps_its_minimum():
    move = decide_roles(windows(3, 1, queued=30000), TARGETS, WHOLE, None, NOW)
    assert move.taker is None and "decode is at its minimum 1" in move.reason
    assert decide_roles(windows(3, 2, queued=30000), TARGETS, BudgetConfig(min_decode=2, mixed=False), None, NOW).taker is None


def test_guards_stale_cold_settling_and_dwell():
    hot = dict(queued=8192, kv=0.1)
    assert "stale" in decide_roles(windows(1, 3, now=NOW - 6, **hot), TARGETS, CFG, None, NOW).reason
    assert "cold start" in decide_roles(windows(1, 3, span_s=5, **hot), TARGETS, CFG, None, NOW).reason
    # the last switch completed 4 s ago: the window still holds samples from before it
    assert "settling" in decide_roles(windows(1, 3, **hot), TARGETS, CFG, NOW - 4, NOW).reason
    # a full window since the switch, but within the dwell time
    fresh = windows(1, 3, span_s=10, **hot)
    assert "dwell" in decide_roles(fresh, TARGETS, CFG, NOW - 11, NOW).reason
    assert decide_roles(fresh, TARGETS, CFG, NOW - 16, NOW).taker == "prefill"


def test_a_window_that_saw_another_worker_count_waits():
    w = windows(1, 3, queued=8192, kv=0.1)
    changed = steady_window(2, NOW, 10.0, kv_usage=0.1)
    w["decode"] = type(changed)(changed.samples[:3] + w["decode"].samples[3:])  # 2 workers, then 3
    assert "settling" in decide_roles(w, TARGETS, CFG, None, NOW).reason


def test_a_latency_with_no_requests_is_no_evidence():
    p = pressure("decode", steady_window(2, NOW, 10.0, kv_usage=0.35, itl_p90_s=None), TARGETS["decode"])
    assert (p.mean, p.signal) == (pytest.approx(0.5), "kv_usage")


def test_config_errors_name_the_key():
    with pytest.raises(BudgetConfigError, match="low: must be below high"):
        BudgetConfig(high=1.0, low=1.0)
    with pytest.raises(BudgetConfigError, match="dwell_s: must be a number > 0"):
        BudgetConfig(dwell_s=0)
    with pytest.raises(BudgetConfigError, match="min_prefill: must be at least 1"):
        BudgetConfig(min_prefill=0)


def test_a_shifting_load_moves_workers_back_and_forth_without_flapping():
    """Four workers; the demand moves from long prompts to long answers and back. Each pool's
    load spreads over its workers (the prefill backlog per worker, the KV demand per worker), the
    controller samples once a second and a switch takes 2 s. The policy follows each phase with
    few moves, and never reverses a move within the dwell time."""
    cfg, dt, switch_s = WHOLE, 1.0, 2.0  # (the mixed role: below)
    roles = {"prefill": 2, "decode": 2}
    history = {"prefill": [], "decode": []}
    last_switch, busy_until, moves = None, -1.0, []

    def demand(t):  # (prefill backlog in tokens, decode KV demand in single workers' caches)
        return (24000, 0.3) if t < 120 else (1000, 2.4) if t < 240 else (24000, 0.3)

    from pdserve.cluster.autoscaling import MetricsWindow, PoolSample
    t = 0.0
    while t < 360:
        backlog, kv = demand(t)
        history["prefill"].append(PoolSample(t, roles["prefill"], queued_prompt_tokens=backlog))
        history["decode"].append(PoolSample(t, roles["decode"], kv_usage=min(1.0, kv / roles["decode"])))
        if t >= busy_until:
            w = {pool: MetricsWindow.trailing(history[pool], t, cfg.window_s) for pool in roles}
            move = decide_roles(w, TARGETS, cfg, last_switch, t)
            if move.taker:
                roles[move.donor] -= 1
                roles[move.taker] += 1
                busy_until = last_switch = t + switch_s
                moves.append((t, move.taker))
        t += dt
    phases = [[taker for at, taker in moves if lo <= at < hi] for lo, hi in ((0, 120), (120, 240), (240, 360))]
    assert phases[0] and set(phases[0]) == {"prefill"}, moves
    assert phases[1] and set(phases[1]) == {"decode"}, moves
    assert phases[2] and set(phases[2]) == {"prefill"}, moves
    assert len(moves) <= 8, moves
    assert all(b[0] - a[0] >= cfg.dwell_s for a, b in zip(moves, moves[1:])), moves
    assert roles["prefill"] >= 1 and roles["decode"] >= 1


# ---- the mixed role: half moves where a whole one is refused --------------------------------

def test_two_workers_under_a_prompt_backlog_make_the_decode_worker_mixed():
    """1P:1D: each pool at its minimum, so no whole move; the decode worker, comfortable,
    prefills its own streams too."""
    move = decide_roles(windows(1, 1, queued=8192, kv=0.1, itl=0.05), TARGETS, CFG, None, NOW)
    assert (move.source, move.target, move.label) == ("decode", "mixed", "prefill_pressure"), move.reason
    assert "decode is at its minimum 1" in move.reason
    # a decode pool under its own targets takes prompts too, however near them; one over them does not
    near = decide_roles(windows(1, 1, queued=8192, kv=0.1, itl=0.19), TARGETS, CFG, None, NOW)  # ITL 0.95 < high
    assert near.target == "mixed", near.reason
    slow = decide_roles(windows(1, 1, queued=8192, kv=0.1, itl=0.21), TARGETS, CFG, None, NOW)  # ITL 1.05
    assert slow.taker is None and "nothing to move" in slow.reason
    full = decide_roles(windows(1, 1, queued=8192, kv=0.69), TARGETS, CFG, None, NOW)  # KV 0.99 of its target
    assert full.target == "mixed"
    assert decide_roles(windows(1, 1, queued=8192, kv=0.1), TARGETS, WHOLE, None, NOW).taker is None


def test_a_whole_move_comes_before_a_half_one():
    move = decide_roles(windows(1, 3, queued=8192, kv=0.1), TARGETS, CFG, None, NOW)
    assert (move.source, move.target) == ("decode", "prefill")


def test_once_every_decode_worker_is_mixed_the_prefill_pool_gets_nothing_more():
    move = decide_roles(windows(1, 1, queued=8192, kv=0.1), TARGETS, CFG, None, NOW, mixed=1)
    assert move.taker is None


def test_slow_tokens_turn_a_mixed_worker_back_to_decode_first():
    move = decide_roles(windows(1, 2, kv=0.1, itl=0.3), TARGETS, CFG, None, NOW, mixed=1)
    assert (move.source, move.target, move.label) == ("mixed", "decode", "decode_pressure"), move.reason
    # ... when the prefill pool can take the prompts back: under low, not merely under high
    held = decide_roles(windows(1, 2, kv=0.1, itl=0.3, queued=3500), TARGETS, CFG, None, NOW, mixed=1)  # 0.85
    assert held.taker is None and "could not take a mixed worker's prompts back" in held.reason
    # without a mixed worker the same window moves a whole prefill worker... when it may
    assert decide_roles(windows(2, 2, kv=0.1, itl=0.3), TARGETS, CFG, None, NOW).source == "prefill"
    # a full KV cache is not helped by unmixing: a whole worker moves instead
    kv = decide_roles(windows(2, 2, kv=0.9), TARGETS, CFG, None, NOW, mixed=1)
    assert (kv.source, kv.target) == ("prefill", "decode")


def test_two_workers_through_a_prompt_burst_mix_once_and_unmix_when_tokens_slow():
    """1P:1D sampled once a second: a prompt backlog (prefill pressed, decode idle) makes the
    decode worker mixed; the backlog drains, and then the mixed worker's ITL passes its SLO
    (its streams share steps with prompts), which turns it back to decode. One move each way,
    the dwell between them."""
    from pdserve.cluster.autoscaling import MetricsWindow, PoolSample
    cfg = BudgetConfig()
    history = {"prefill": [], "decode": []}
    mixed, last_switch, moves = 0, None, []
    for t in range(0, 120):
        backlog = 0 if mixed else 8192 if t < 60 else 0
        itl = 0.05 if not mixed else 0.1 if t < 60 else 0.3
        history["prefill"].append(PoolSample(float(t), 1, queued_prompt_tokens=backlog))
        history["decode"].append(PoolSample(float(t), 1, kv_usage=0.05, itl_p90_s=itl))
        w = {pool: MetricsWindow.trailing(history[pool], float(t), cfg.window_s) for pool in history}
        move = decide_roles(w, TARGETS, cfg, last_switch, float(t), mixed=mixed)
        if move.taker:
            mixed += 1 if move.target == "mixed" else -1
            last_switch = float(t)
            moves.append((t, move.source, move.target))
    assert [(a, b) for _, a, b in moves] == [("decode", "mixed"), ("mixed", "decode")], moves
    assert moves[1][0] - moves[0][0] >= cfg.dwell_s


def test_a_hold_while_a_pool_is_pressed_is_logged_once_a_window(caplog):
    """The controller logs why a pressed pool got no worker (at most once a window); holds with
    both pools calm stay at debug."""
    import logging

    from pdserve.cluster.role_balancer import RoleBalancer

    balancer = RoleBalancer(None, CFG, TARGETS)
    pressed = decide_roles(windows(2, 2, queued=20000, kv=0.9), TARGETS, CFG, None, NOW)  # both hot: a hold
    calm = decide_roles(windows(2, 2, queued=4000, kv=0.5), TARGETS, CFG, None, NOW)
    with caplog.at_level(logging.INFO, logger="pdserve.cluster.role_balancer"):
        for t in (0.0, 1.0, CFG.window_s + 0.5):
            balancer._log_hold(t, pressed)
        balancer._log_hold(100.0, calm)
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(logged) == 2 and all("nothing to move" in m for m in logged), logged
