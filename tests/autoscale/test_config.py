"""Config: defaults are valid and independent per pool; bad values and bad policy paths fail at
construction with the key and the limit named."""

import pytest

from pdserve.cluster.autoscaling import (DEFAULTS, AutoscaleConfigError, PoolPolicyConfig, decode_policy, from_mapping,
                                 load_policy, pool_config, prefill_policy)


def test_defaults_per_pool():
    prefill, decode = DEFAULTS["prefill"], DEFAULTS["decode"]
    assert load_policy(prefill.policy) is prefill_policy and load_policy(decode.policy) is decode_policy
    assert (prefill.target, prefill.slo_s, decode.target, decode.slo_s) == (4096.0, 2.0, 0.7, 0.2)
    for cfg in (prefill, decode):
        assert cfg.scale_down_cooldown_s > cfg.scale_up_cooldown_s
        assert cfg.scale_down_threshold < 1.0 < cfg.scale_up_threshold
        assert (cfg.min_replicas, cfg.step) == (1, 1)
        # down at the threshold from 2 replicas leaves the survivor below the up threshold
        assert cfg.scale_down_threshold * 2 < cfg.scale_up_threshold


@pytest.mark.parametrize("overrides, key, limit", [
    ({"min_replicas": 0}, "min_replicas", ">= 1"),
    ({"min_replicas": 3, "max_replicas": 2}, "max_replicas", ">= min_replicas (3)"),
    ({"step": 0}, "step", ">= 1"),
    ({"step": 1.5}, "step", "an integer"),
    ({"max_replicas": True}, "max_replicas", "an integer"),
    ({"target": 0}, "target", "> 0"),
    ({"slo_s": -1}, "slo_s", "> 0"),
    ({"window_s": float("nan")}, "window_s", "finite"),
    ({"scale_up_threshold": 0.9}, "scale_up_threshold", ">= 1.0"),
    ({"scale_down_threshold": 1.0}, "scale_down_threshold", "< 1.0"),
    ({"scale_up_cooldown_s": -1}, "scale_up_cooldown_s", ">= 0"),
    ({"scale_up_cooldown_s": 30, "scale_down_cooldown_s": 20}, "scale_down_cooldown_s",
     ">= scale_up_cooldown_s (30)"),
])
def test_bad_value_names_key_and_limit(overrides, key, limit):
    with pytest.raises(AutoscaleConfigError) as err:
        pool_config("prefill", **overrides)
    assert err.value.key == key and limit in str(err.value)


def test_unknown_pool():
    with pytest.raises(AutoscaleConfigError, match="pool: must be one of"):
        pool_config("embed")


def test_from_mapping_configures_each_pool_on_its_own():
    cfgs = from_mapping({"prefill": {"max-replicas": 8, "target": 1000}, "decode": {"scale_down_cooldown_s": 120}})
    assert (cfgs["prefill"].max_replicas, cfgs["prefill"].target) == (8, 1000)
    assert cfgs["prefill"].scale_down_cooldown_s == 60.0
    assert cfgs["decode"].max_replicas == 4 and cfgs["decode"].scale_down_cooldown_s == 120
    assert from_mapping({}) == DEFAULTS


@pytest.mark.parametrize("values, key", [
    ({"decode": {"step": 0}}, "autoscaling.decode.step"),
    ({"prefill": {"min_replica": 2}}, "autoscaling.prefill.min_replica"),
    ({"embed": {}}, "autoscaling.embed"),
    ({"prefill": [1, 2]}, "autoscaling.prefill"),
])
def test_from_mapping_errors_name_the_full_key(values, key):
    with pytest.raises(AutoscaleConfigError) as err:
        from_mapping(values)
    assert err.value.key == key and str(err.value).startswith(key + ": ")


@pytest.mark.parametrize("path, problem", [
    ("no_colon_here", "must look like 'package.module:function'"),
    ("a:b:c", "must look like"),
    ("tests.autoscale.nowhere:policy", "cannot import module 'tests.autoscale.nowhere'"),
    ("tests.autoscale.custom_policies:missing", "has no attribute 'missing'"),
    ("tests.autoscale.custom_policies:NOT_CALLABLE", "is a int, not a callable"),
    ("tests.autoscale.custom_policies:two_args", "must accept (pool, window, config, state, now)"),
])
def test_bad_policy_path_names_the_key_and_the_path(path, problem):
    with pytest.raises(AutoscaleConfigError) as err:
        from_mapping({"prefill": {"policy": path}})
    assert err.value.key == "autoscaling.prefill.policy"
    assert problem in str(err.value) and repr(path).strip("'") in str(err.value)


def test_config_is_frozen():
    with pytest.raises(AttributeError):
        DEFAULTS["decode"].target = 0.9  # type: ignore[misc]
    assert isinstance(DEFAULTS["decode"], PoolPolicyConfig)
