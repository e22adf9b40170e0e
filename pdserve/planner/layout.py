"""What the simulator runs (``pdserve.planner.simulator``): the cluster's layout, workers per pool
and tensor parallelism each, and its spec, the layout with each role's cost model and the
engine's and router's limits."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.planner.cost import CostModel
from pdserve.planner.worker import EngineLimits
from pdserve.router.limits import RouterLimits


@dataclass(frozen=True)
class Layout:
    """Workers per pool and tensor parallelism per worker. Colocated: ``colocated`` > 0, the others 0."""

    prefill: int = 0
    decode: int = 0
    colocated: int = 0
    tp_prefill: int = 1
    tp_decode: int = 1

    @property
    def mode(self) -> str:
        return "colocated" if self.colocated else "disaggregated"

    @property
    def gpus(self) -> int:
        return self.prefill * self.tp_prefill + self.decode * self.tp_decode + self.colocated * self.tp_decode

    def describe(self) -> str:
        if self.colocated:
            return f"{self.colocated} colocated worker(s) x TP{self.tp_decode}"
        return f"{self.prefill}P (TP{self.tp_prefill}) : {self.decode}D (TP{self.tp_decode})"


@dataclass(frozen=True)
class ClusterSpec:
    layout: Layout
    prefill_cost: CostModel
    decode_cost: CostModel
    limits: EngineLimits = field(default_factory=EngineLimits)
    # Prefill workers' own limits where they differ (DistServe ran its prefill and decode
    # instances with different batch limits); None: ``limits`` for every role.
    prefill_limits: EngineLimits | None = None
    max_queued_tokens: int = RouterLimits.max_queued_tokens_per_prefill  # the router's own limits
    admission_wait_s: float = RouterLimits.admission_wait_s
    startup_s: float = 30.0  # a new worker's time to load the model (autoscaling)
