"""The controller's autoscaler keeps a bounded history: a cluster that runs for days holds
the last ``history`` samples and decisions per pool, not every one since it started."""

import pytest

from pdserve.cluster.autoscaler import Autoscaler, PoolTrace
from pdserve.cluster.autoscaling.config import pool_config
from pdserve.cluster.autoscaling.window import PoolSample


class StillCluster:
    """A cluster of one idle worker per pool that never changes (no Ray, no RPCs)."""

    def addresses(self, pool):
        return []

    def push_membership(self):
        pass


def test_the_autoscaler_keeps_only_the_last_history_samples_and_decisions(monkeypatch):
    scaler = Autoscaler(StillCluster(), {p: pool_config(p) for p in ("prefill", "decode")}, history=50)
    monkeypatch.setattr(scaler, "_latency", lambda window_s: None)
    monkeypatch.setattr(scaler, "sample", lambda pool, now, latency=None: PoolSample(now, 1))
    for t in range(500):
        scaler.step(float(t))
    for pool in ("prefill", "decode"):
        trace = scaler.traces[pool]
        assert len(trace.samples) == len(trace.decisions) == 50
        assert [s.t for s in trace.samples] == [float(t) for t in range(450, 500)]  # the newest, in order
    assert scaler.desired() == {"prefill": 1, "decode": 1}


def test_a_history_limit_below_one_is_refused():
    with pytest.raises(ValueError, match="history limit"):
        PoolTrace(limit=0)
