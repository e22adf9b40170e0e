"""What the simulator runs (``pdserve.planner.simulator``): the cluster's layout, workers per pool
and tensor parallelism each, and its spec, the layout with each role's cost model and the
engine's and router's limits."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.planner.cost import CostError, CostModel
from pdserve.planner.worker import EngineLimits
from pdserve.router.limits import RouterLimits
from pdserve.router.local_prefill import LocalPrefillConfig


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
    # Prefill that keeps up (pdserve/router/local_prefill.py ``behind``): a prompt the prefill pool
    # would start later than this is prefilled by its decode worker when that is sooner; 0: off ...
    overflow_ttft_s: float = 0.0
    overflow_slowdown: float = LocalPrefillConfig.overflow_slowdown  # ... a token there costs this many times more
    # Time-sized chunks (pdserve/planner/mixed_step.py): a worker's mixed step aims at this many
    # seconds; 0: off, a prompt beside streams is prefilled in one step (prefill first).
    step_target_s: float = 0.0
    # The KV tier below each host's prefix caches (pdserve/planner/prefix_cache.py), bytes per
    # host; 0: none, an evicted prefix is computed again.
    kv_offload_bytes: int = 0

    def __post_init__(self) -> None:
        if self.kv_offload_bytes < 0:
            raise CostError("kv_offload_bytes", f"must be >= 0 (0: no KV tier), got {self.kv_offload_bytes}")
        if not self.kv_offload_bytes:
            return
        # The engine's refusals (LLMEngine, issue 58): its tier runs under the prefix cache, at TP1.
        lay = self.layout
        if max(lay.tp_prefill, lay.tp_decode) > 1:
            raise CostError("kv_offload_bytes", f"the KV tier runs at TP1 only, got {lay.describe()}")
        if not all(lim.enable_prefix_cache for lim in (self.limits, self.prefill_limits) if lim is not None):
            raise CostError("kv_offload_bytes", "the KV tier needs the prefix cache (enable_prefix_cache)")
