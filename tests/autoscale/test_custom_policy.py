"""A user's policy, plugged in by import path, runs behind the same guards as the built-in."""

import pytest

from pdserve.cluster.autoscaling import ScalerState, decide, from_mapping, pool_config
from tests.autoscale.helpers import simulate, steady_window

ALWAYS_UP = "tests.autoscale.custom_policies:always_up"


def test_custom_policy_by_import_path_drives_decisions():
    cfg = from_mapping({"decode": {"policy": ALWAYS_UP}})["decode"]
    d = decide("decode", steady_window(1, 100.0, 20.0), cfg, ScalerState(), now=100.0)
    assert (d.action, d.desired, d.proposed) == ("up", 2, 11) and d.reason.startswith("up: always")


def test_custom_policy_is_still_guarded():
    cfg = pool_config("decode", policy=ALWAYS_UP, max_replicas=3)
    cold = decide("decode", steady_window(1, 100.0, 5.0), cfg, ScalerState(), now=100.0)
    assert cold.action == "hold" and "cold start" in cold.reason
    run = simulate("decode", cfg, lambda t, n: {}, 300)
    ups = [t for t, d in run.changes]
    assert run.final_replicas == 3 and len(ups) == 2
    assert ups[1] - ups[0] >= cfg.window_s  # one step at a time, each after a settled window


def test_custom_policy_leaves_the_other_pool_on_its_default():
    cfgs = from_mapping({"decode": {"policy": ALWAYS_UP}})
    idle = steady_window(1, 100.0, 20.0)
    assert decide("prefill", idle, cfgs["prefill"], ScalerState(), now=100.0).action == "hold"


def test_custom_policy_returning_the_wrong_type_is_named():
    cfg = pool_config("prefill", policy="tests.autoscale.custom_policies:returns_int")
    with pytest.raises(TypeError, match="returns_int' returned int, not a ScalingDecision"):
        decide("prefill", steady_window(1, 100.0, 20.0), cfg, ScalerState(), now=100.0)
