"""The autoscaling loop: sample each pool, ask its policy (``pdserve.cluster.autoscaling``), act.

Every ``interval_s`` the loop reads each live worker's stats and the router's latencies since
the last round, turns them into one ``PoolSample`` per pool (prefill: queued prompt tokens
summed over the pool and TTFT p90; decode: KV usage averaged over the pool and ITL p90), and
calls ``decide`` over the pool's trailing window.
Each decision is logged with its inputs and kept in ``decisions``. A scale-up starts one
worker (Ray's autoscaler adds a node if no node can hold its placement group); a scale-down
drains one (it leaves the routing table first and stops only once idle), so no client sees
an error. With ``observe_only`` (plain Kubernetes, where KEDA or an HPA owns the counts)
the loop decides, logs and exports the same way but never starts or drains a worker, and a
decision leaves no pending change behind (nobody will carry it out).
A round in which no request got its first token (or no token after it) has no
latency: no evidence either way, never a zero.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field

import grpc

from pdserve.cluster.autoscaling import MetricsWindow, PoolPolicyConfig, PoolSample, ScalerState, ScalingDecision, decide
from pdserve.cluster.round_loop import RoundLoop
from pdserve.cluster.supervisor import worker_stats
from pdserve.protos import admin_pb2, admin_pb2_grpc, worker_pb2
from pdserve.wire.grpc_util import channel
from pdserve.wire.tls import TlsConfig

log = logging.getLogger(__name__)
POOLS = ("prefill", "decode")


# Samples and decisions kept per pool: at the default 1 s interval, the last hour. Older ones
# are dropped (the policy reads only its trailing window, a few tens of seconds), so a
# long-running controller neither grows nor rescans an ever longer history.
HISTORY = 3600


@dataclass
class PoolTrace:
    """What the loop saw and decided for one pool, for logs, plots and tests: the last
    ``limit`` samples and decisions, oldest first."""

    samples: list[PoolSample] = field(default_factory=list)
    decisions: list[ScalingDecision] = field(default_factory=list)
    state: ScalerState = field(default_factory=ScalerState)
    limit: int = HISTORY

    def __post_init__(self) -> None:
        if self.limit < 1:
            raise ValueError(f"history limit must be >= 1, got {self.limit}")

    def record(self, sample: PoolSample | None = None, decision: ScalingDecision | None = None) -> None:
        for kept, item in ((self.samples, sample), (self.decisions, decision)):
            if item is not None:
                kept.append(item)
                del kept[:-self.limit]  # at most one item: a short move of pointers


class Autoscaler(RoundLoop):
    name = "autoscaler"

    def __init__(self, cluster, configs: dict[str, PoolPolicyConfig], interval_s: float = 1.0,
                 history: int = HISTORY, observe_only: bool = False):
        super().__init__(interval_s)
        self.cluster = cluster
        self.observe_only = observe_only
        self.configs = configs
        self.pools = tuple(p for p in POOLS if p in configs)  # the pools it scales (colocated: decode only)
        self.traces = {pool: PoolTrace(limit=history) for pool in self.pools}
        self._last_step: float | None = None
        self._actions: dict[str, threading.Thread] = {}  # pool -> its scale action in progress

    def stop(self, join_s: float = 60.0) -> None:
        super().stop(join_s)
        for action in list(self._actions.values()):
            action.join(2 * join_s)

    def round(self) -> None:
        self.step(time.monotonic())

    def step(self, now: float) -> None:
        since = self._last_step
        self._last_step = now
        latency = self._latency(now - since if since is not None else self.interval_s)
        for pool in self.pools:
            trace = self.traces[pool]
            trace.record(sample=self.sample(pool, now, latency))
            window = MetricsWindow.trailing(trace.samples, now, self.configs[pool].window_s)
            decision = decide(pool, window, self.configs[pool], trace.state, now)
            state = trace.state.after(decision, now)
            trace.state = dataclasses.replace(state, desired=None) if self.observe_only else state
            trace.record(decision=decision)
            if decision.action != "hold":
                log.info("autoscaler %s: %s", pool, decision.as_dict())
                self.cluster.push_membership()  # the router exports the new desired size at once
            else:  # every round, with its inputs: --log-level debug shows why nothing changed
                log.debug("autoscaler %s: %s", pool, decision.as_dict())
            self._act(pool, decision)

    def desired(self) -> dict[str, int]:
        """Each pool's last decided size (exported by the router as autoscaler_desired_replicas)."""
        return {pool: t.decisions[-1].desired for pool, t in self.traces.items() if t.decisions}

    def sample(self, pool: str, now: float, latency: admin_pb2.LatencySummary | None = None) -> PoolSample:
        return sample_pool(self.cluster, pool, now, latency)

    def _latency(self, window_s: float) -> admin_pb2.LatencySummary | None:
        return router_latency(self.cluster, window_s)

    def pending(self) -> bool:
        """A scale change still under way (decided, not yet done): the role balancer waits."""
        return any(a.is_alive() for a in self._actions.values()) or any(
            t.state.pending(t.samples[-1].replicas) for t in self.traces.values() if t.samples)

    def roles_moved(self, donor: str, taker: str) -> None:
        """An elastic worker moved ``donor`` -> ``taker`` (``pdserve.cluster.role_balancer``):
        the desired counts follow, or the pools would look mid-change to the guards for good."""
        for pool, delta in ((donor, -1), (taker, 1)):
            trace = self.traces.get(pool)
            if trace is not None and trace.state.desired is not None:
                trace.state = dataclasses.replace(trace.state, desired=trace.state.desired + delta)

    def _act(self, pool: str, decision: ScalingDecision) -> None:
        """Start the change in a thread of its own: a worker takes seconds to load and a drain
        as long as its longest stream, and sampling must go on meanwhile (the policy's
        pending-change guard holds the pool until the change shows in its ready replicas)."""
        if decision.desired == decision.current or self._stop.is_set() or self.observe_only:
            return
        previous = self._actions.get(pool)  # a drain still finishing; changes apply in order
        action = threading.Thread(target=self._apply, args=(pool, decision, previous),
                                  name=f"pdserve-autoscale-{pool}", daemon=True)
        self._actions[pool] = action
        action.start()

    def _apply(self, pool: str, decision: ScalingDecision, previous: threading.Thread | None) -> None:
        if previous is not None:
            previous.join()
        try:
            for _ in range(decision.desired - decision.current):
                self.cluster.scale_up(pool)
            for _ in range(decision.current - decision.desired):
                self.cluster.scale_down(pool)
        except Exception:  # the next decision sees the pool as it really is
            log.exception("autoscaler %s: scaling to %d failed", pool, decision.desired)


def sample_pool(cluster, pool: str, now: float, latency: admin_pb2.LatencySummary | None = None) -> PoolSample:
    """One ``PoolSample`` of ``pool``: its live workers' stats and the router's latencies."""
    stats = [s for s in (_stats(pool, a, cluster.config.tls_for("controller")) for a in list(cluster.addresses(pool)))
             if s is not None]
    latency = latency or admin_pb2.LatencySummary()
    if pool == "prefill":
        return PoolSample(now, len(stats), queued_prompt_tokens=sum(s.num_waiting_tokens for s in stats),
                          ttft_p90_s=latency.ttft_p90_s if latency.HasField("ttft_p90_s") else None)
    usage = [s.num_blocks_used / s.num_blocks_total for s in stats if s.num_blocks_total]
    return PoolSample(now, len(stats), kv_usage=sum(usage) / len(usage) if usage else 0.0,
                      itl_p90_s=latency.itl_p90_s if latency.HasField("itl_p90_s") else None)


def router_latency(cluster, window_s: float) -> admin_pb2.LatencySummary | None:
    """The router's TTFT and ITL p90 over the last ``window_s``; None if it cannot answer."""
    try:
        with channel(cluster.admin_address, cluster.config.tls_for("controller"), peer="router") as ch:
            return admin_pb2_grpc.RouterAdminStub(ch).GetLatency(admin_pb2.LatencyRequest(window_s=window_s), timeout=2)
    except grpc.RpcError as exc:
        log.warning("router latencies unavailable this round: %s", exc.code().name)
        return None


def _stats(pool: str, address: str, tls: TlsConfig | None) -> worker_pb2.WorkerStats | None:
    """None for a worker dead or busy: the supervisor deals with those."""
    return worker_stats(pool, address, tls, timeout_s=2.0)
