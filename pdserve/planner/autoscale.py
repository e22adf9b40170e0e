"""The real autoscaling policies, driven by the simulator instead of a cluster.

Once a second (``interval_s``) the driver samples each pool the way ``pdserve/cluster/autoscaler.py``
does (prefill: queued prompt tokens summed over the pool and TTFT p90 of the first tokens
since the last sample; decode: KV usage averaged over the pool and ITL p90), calls
``pdserve.cluster.autoscaling.decide`` over the trailing window with the pool's ``ScalerState``, and
acts: a scale-up adds a worker ``startup_s`` later (the model load), a scale-down drains the
least-loaded worker. Disaggregated layouts only (the policies are per pool).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from pdserve.cluster.autoscaling import MetricsWindow, PoolPolicyConfig, PoolSample, ScalerState, decide
from pdserve.planner.metrics import weighted_percentiles

POOLS = ("prefill", "decode")


class AutoscaleDriver:
    def __init__(self, configs: dict[str, PoolPolicyConfig], interval_s: float = 1.0):
        self.configs = configs
        self.interval_s = interval_s
        self.states = {pool: ScalerState() for pool in POOLS}
        self._samples: dict[str, deque[PoolSample]] = {pool: deque() for pool in POOLS}
        self._starting = {pool: 0 for pool in POOLS}
        # pool -> [(t, ready replicas, desired, primary signal)], for plots
        self.history: dict[str, list[tuple[float, int, int, float]]] = {pool: [] for pool in POOLS}

    def tick(self, sim, now: float) -> None:
        samples = {"prefill": self._prefill_sample(sim, now), "decode": self._decode_sample(sim, now)}
        sim.recent_ttft.clear()
        sim.recent_itl.clear()
        for pool in POOLS:
            self._decide(sim, pool, samples[pool], now)

    def _decide(self, sim, pool: str, sample: PoolSample, now: float) -> None:
        cfg, window = self.configs[pool], self._samples[pool]
        window.append(sample)
        while len(window) > 2 and window[1].t <= now - cfg.window_s:
            window.popleft()  # keep the one sample at or before the window's start
        decision = decide(pool, MetricsWindow(tuple(window)), cfg, self.states[pool], now)
        self.states[pool] = self.states[pool].after(decision, now)
        ready = sample.replicas
        if decision.desired > ready + self._starting[pool]:
            for _ in range(decision.desired - ready - self._starting[pool]):
                self._starting[pool] += 1
                sim.start_worker_later(self, pool)
        elif decision.desired < ready:
            for _ in range(ready - decision.desired):
                sim.drain_worker(pool)
        signal = sample.queued_prompt_tokens / max(ready, 1) if pool == "prefill" else sample.kv_usage
        self.history[pool].append((now, ready, decision.desired, signal))

    def worker_ready(self, sim, pool: str) -> None:
        self._starting[pool] -= 1
        sim.add_worker(pool)

    @staticmethod
    def _prefill_sample(sim, now: float) -> PoolSample:
        workers = sim.pools["prefill"]
        ttft = float(np.percentile(sim.recent_ttft, 90)) if sim.recent_ttft else None
        return PoolSample(now, len(workers), queued_prompt_tokens=int(sum(w.queued_tokens for w in workers)),
                          ttft_p90_s=ttft)

    @staticmethod
    def _decode_sample(sim, now: float) -> PoolSample:
        workers = sim.pools["decode"]
        usage = float(np.mean([w.kv_usage for w in workers])) if workers else 0.0
        itl = None
        if sim.recent_itl:
            values = np.array(sim.recent_itl)
            itl = weighted_percentiles(values[:, 0], values[:, 1])["p90"]
        return PoolSample(now, len(workers), kv_usage=min(max(usage, 0.0), 1.0), itl_p90_s=itl)

