"""The calibration's reading of a step trace: which steps fall in a run, what each one's served
seconds are (its own, plus the loop's time before it unless the loop was idle), and the one
speed factor per pool that the run's simulation scales the profile by. Trace files written by
the real ``StepTrace``; the profile is the repository's CPU profile."""

import dataclasses

import pytest

from benchmarks.planner.calibrate import NoisyPrefill, at_run_speed, run_speed
from benchmarks.planner.served_runs import traced_steps
from pdserve.engine.core.step_trace import StepShape, StepTrace, trace_path
from pdserve.planner.cost import CostModel
from pdserve.planner.hardware import DEFAULT_CPU_PROFILE, HardwareProfile
from pdserve.planner.model_spec import get_model


def write(directory, worker_id, steps):
    trace = StepTrace(trace_path(directory, worker_id))
    for start, seconds, idle, shape in steps:
        trace.write(start, seconds, idle, shape)
    trace.close()


def prefill(*chunks):
    return StepShape(tuple(chunks), 0, 0, len(chunks))


def decode(batch, context):
    return StepShape((), batch, context, batch)


def test_steps_in_the_window_with_the_loop_time_before_each_unless_idle(tmp_path):
    write(tmp_path, "prefill-0", [(99.0, 0.5, True, prefill((256, 0))),  # before the run
                                  (100.0, 0.7, True, prefill((256, 0))),
                                  (100.71, 1.4, False, prefill((256, 0), (256, 0)))])  # 10 ms of loop before it
    write(tmp_path, "decode-0", [(100.8, 0.02, True, decode(1, 256)),
                                 (100.823, 0.02, False, decode(1, 257)),  # 3 ms of loop before it
                                 (100.9, 0.05, False, StepShape(((16, 0),), 1, 258, 2)),  # a local prefill: left out
                                 (103.0, 0.02, True, decode(1, 259))])  # after the run
    steps = traced_steps(str(tmp_path), 100.0, 102.0)
    assert steps["prefill"] == [[0.7, [[256, 0]], 1], [pytest.approx(1.41), [[256, 0], [256, 0]], 2]]
    assert steps["decode"] == [[0.02, 1, 256], [pytest.approx(0.023), 1, 257]]


def test_a_cluster_without_a_trace_is_named(tmp_path):
    write(tmp_path, "prefill-0", [(100.0, 0.7, True, prefill((256, 0)))])
    with pytest.raises(SystemExit, match="no decode worker's step trace.*--step-trace-dir"):
        traced_steps(str(tmp_path), 0.0, 200.0)


def test_the_speed_is_served_over_profile_seconds_per_pool_and_scales_only_the_steps():
    profile = dataclasses.replace(HardwareProfile.load(DEFAULT_CPU_PROFILE), served_step_s=2e-3, served_seq_s=3e-4,
                                  served_prefill_factor=1.1, kv_transfer_overhead_s=9e-3)
    bare = CostModel(get_model("SmolLM2-135M"), dataclasses.replace(
        profile, served_step_s=0.0, served_seq_s=0.0, served_prefill_factor=1.0), 1)
    steps = {"prefill": [[1.2 * bare.prefill_s([(256, 0)], 1), [[256, 0]], 1],
                         [1.2 * bare.prefill_s([(256, 0), (128, 0)], 2), [[256, 0], [128, 0]], 2]],
             "decode": [[0.9 * bare.decode_s(8, 8 * 300), 8, 8 * 300], [0.9 * bare.decode_s(1, 290), 1, 290]]}
    speed = run_speed(steps, profile)  # against the engine's own steps: the probe's additions left out
    assert speed == {"prefill": pytest.approx(1.2), "decode": pytest.approx(0.9), "prefill_sigma": pytest.approx(0.0, abs=1e-12)}
    fast = CostModel(get_model("SmolLM2-135M"), at_run_speed(profile, speed), 1)
    assert fast.decode_s(4, 1200) == pytest.approx(0.9 * bare.decode_s(4, 1200))  # no probe step cost on top
    assert fast.prefill_s([(200, 56)]) == pytest.approx(1.2 * bare.prefill_s([(200, 56)]))
    assert fast.transfer_s(256) == bare.transfer_s(256)  # the hand-off the probe measured stays


def test_the_prefill_spread_is_the_log_sd_of_the_steps_and_noisy_prefill_draws_it_around_the_step():
    import numpy as np

    profile = HardwareProfile.load(DEFAULT_CPU_PROFILE)
    cost = CostModel(get_model("SmolLM2-135M"), profile, 1)
    one = cost.prefill_s([(256, 0)], 1)
    steps = {"prefill": [[1.1 * one, [[256, 0]], 1], [1.3 * one, [[256, 0]], 1]], "decode": [[0.02, 1, 300]]}
    assert run_speed(steps, profile)["prefill_sigma"] == pytest.approx(np.std(np.log([1.1, 1.3])))
    noisy = NoisyPrefill(cost, 0.1, seed=0)
    draws = np.array([noisy.prefill_s([(256, 0)], 1) / one for _ in range(4000)])
    assert draws.mean() == pytest.approx(1.0, abs=0.01) and np.log(draws).std() == pytest.approx(0.1, abs=0.005)
    assert noisy.decode_s(4, 1000) == cost.decode_s(4, 1000)  # decode steps are the model's own
