"""Policies loaded by import path in the custom-policy tests."""

from pdserve.cluster.autoscaling import DecisionInputs, ScalingDecision

NOT_CALLABLE = 3


def always_up(pool, window, config, state, now):
    n = window.latest.replicas
    return ScalingDecision(pool, n, n + 10, "up: always", DecisionInputs.of(window, now))


def returns_int(pool, window, config, state, now):
    return window.latest.replicas + 1


def two_args(pool, window):
    return None
