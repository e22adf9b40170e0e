"""The autoscaling loop: sample each pool, ask its policy (``cluster.autoscaling``), act.

Every ``interval_s`` the loop reads each live worker's stats, turns them into one
``PoolSample`` per pool (prefill: queued prompt tokens summed over the pool; decode: KV
usage averaged over the pool), and calls ``decide`` over the pool's trailing window.
Each decision is logged with its inputs and kept in ``decisions``. A scale-up starts one
worker (Ray's autoscaler adds a node if no node can hold its placement group); a scale-down
drains one (it leaves the routing table first and stops only once idle), so no client sees
an error. Latency signals (TTFT and ITL p90) are not sampled yet: they read as "no
evidence", so the pools scale on queue and KV usage alone.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import grpc

from cluster.autoscaling import MetricsWindow, PoolPolicyConfig, PoolSample, ScalerState, ScalingDecision, decide
from protos import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)
POOLS = ("prefill", "decode")


@dataclass
class PoolTrace:
    """What the loop saw and decided for one pool, for logs, plots and tests."""

    samples: list[PoolSample] = field(default_factory=list)
    decisions: list[ScalingDecision] = field(default_factory=list)
    state: ScalerState = field(default_factory=ScalerState)


class Autoscaler:
    def __init__(self, cluster, configs: dict[str, PoolPolicyConfig], interval_s: float = 1.0):
        self.cluster = cluster
        self.configs = configs
        self.interval_s = interval_s
        self.traces = {pool: PoolTrace() for pool in POOLS}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdserve-autoscaler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.step(time.monotonic())
            except Exception:  # keep scaling whatever one round hit
                log.exception("autoscaler round failed")

    def step(self, now: float) -> None:
        for pool in POOLS:
            trace = self.traces[pool]
            trace.samples.append(self.sample(pool, now))
            window = MetricsWindow.trailing(trace.samples, now, self.configs[pool].window_s)
            decision = decide(pool, window, self.configs[pool], trace.state, now)
            trace.state = trace.state.after(decision, now)
            trace.decisions.append(decision)
            if decision.action != "hold":
                log.info("autoscaler %s: %s", pool, decision.as_dict())
                self.cluster.push_membership()  # the router exports the new desired size at once
            self._act(pool, decision)
            if self._stop.is_set():
                return

    def desired(self) -> dict[str, int]:
        """Each pool's last decided size (exported by the router as autoscaler_desired_replicas)."""
        return {pool: t.decisions[-1].desired for pool, t in self.traces.items() if t.decisions}

    def sample(self, pool: str, now: float) -> PoolSample:
        stats = [s for s in (_stats(pool, a) for a in list(self.cluster.addresses(pool))) if s is not None]
        if pool == "prefill":
            return PoolSample(now, len(stats), queued_prompt_tokens=sum(s.num_waiting_tokens for s in stats))
        usage = [s.num_blocks_used / s.num_blocks_total for s in stats if s.num_blocks_total]
        return PoolSample(now, len(stats), kv_usage=sum(usage) / len(usage) if usage else 0.0)

    def _act(self, pool: str, decision: ScalingDecision) -> None:
        for _ in range(decision.desired - decision.current):
            self.cluster.scale_up(pool)
        for _ in range(decision.current - decision.desired):
            self.cluster.scale_down(pool)


def _stats(pool: str, address: str) -> worker_pb2.WorkerStats | None:
    stub_cls = worker_pb2_grpc.PrefillWorkerStub if pool == "prefill" else worker_pb2_grpc.DecodeWorkerStub
    try:
        with grpc.insecure_channel(address) as channel:
            return stub_cls(channel).Stats(worker_pb2.StatsRequest(), timeout=2)
    except grpc.RpcError:
        return None  # dead or busy: the supervisor deals with the dead
