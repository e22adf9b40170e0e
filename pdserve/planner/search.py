"""``pdserve plan``: the fewest GPUs that serve a rate at an SLO attainment.

For each tensor-parallel degree whose weights fit, the search finds the smallest prefill pool
that keeps TTFT within its SLO with decode not the bottleneck, then the smallest decode pool
with that prefill pool, then grows whichever pool helps more until the attainment is met
(exponential then binary search per pool; the simulator's answer is close to monotone in each
pool's size). Colocated layouts are searched the same way, and the cheaper layout wins.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

from pdserve.planner.cost import CostError, CostModel
from pdserve.planner.hardware import HardwareProfile
from pdserve.planner.metrics import SimResult, Slo
from pdserve.planner.model_spec import ModelSpec
from pdserve.planner.layout import ClusterSpec, Layout
from pdserve.planner.simulator import Simulator
from pdserve.planner.synthetic import LengthMix, poisson
from pdserve.planner.trace import TraceRequest
from pdserve.planner.worker import EngineLimits



class PlanError(ValueError):
    def __init__(self, field: str, problem: str):
        self.field = field
        super().__init__(f"{field}: {problem}")


@dataclass(frozen=True)
class PlanRequest:
    model: ModelSpec
    hw: HardwareProfile
    rate: float  # requests/s to serve
    lengths: LengthMix
    slo: Slo
    attainment: float = 0.9  # share of requests that must meet both SLOs
    tp_choices: tuple[int, ...] = (1, 2, 4, 8)
    num_requests: int = 3000  # simulated per candidate; more is steadier and slower
    min_duration_s: float = 60.0
    limits: EngineLimits = dataclasses.field(default_factory=EngineLimits)
    modes: tuple[str, ...] = ("disaggregated", "colocated")
    seed: int = 0
    max_workers: int = 1024  # per pool: the search gives up beyond this
    replay: tuple[TraceRequest, ...] | None = None  # a recorded trace instead of Poisson arrivals

    def __post_init__(self) -> None:
        if self.rate <= 0:
            raise PlanError("rate", f"must be > 0, got {self.rate}")
        if not 0 < self.attainment <= 1:
            raise PlanError("attainment", f"must be within (0, 1], got {self.attainment}")

    def trace(self) -> list[TraceRequest]:
        if self.replay is not None:
            return list(self.replay)
        duration = max(self.min_duration_s, self.num_requests / self.rate)
        return poisson(self.rate, duration, self.lengths, self.seed)


@dataclass(frozen=True)
class Plan:
    layout: Layout
    result: SimResult
    attainment: float

    @property
    def gpus(self) -> int:
        return self.layout.gpus


def simulate(req: PlanRequest, layout: Layout, trace: list[TraceRequest]) -> SimResult:
    cost_p = CostModel(req.model, req.hw, layout.tp_prefill)
    cost_d = CostModel(req.model, req.hw, layout.tp_decode)
    return Simulator(ClusterSpec(layout, cost_p, cost_d, req.limits), trace).run()


def plan(req: PlanRequest, progress: Callable[[str], None] = lambda _: None) -> Plan:
    """The cheapest layout found; ties go to the higher attainment."""
    trace = req.trace()
    best: Plan | None = None
    for tp in req.tp_choices:
        if not _fits(req, tp):
            continue
        for mode in req.modes:
            found = _search_mode(req, trace, mode, tp)
            if found is None:
                continue
            progress(f"TP{tp} {mode}: {found.layout.describe()} = {found.gpus} GPUs, "
                     f"attainment {found.attainment:.3f}")
            if best is None or (found.gpus, -found.attainment) < (best.gpus, -best.attainment):
                best = found
    if best is None:
        raise PlanError("rate", f"no layout of up to {req.max_workers} workers per pool serves {req.rate} req/s at "
                                f"{req.attainment:.0%} attainment of TTFT {req.slo.ttft_s} s / TPOT {req.slo.tpot_s} s")
    return best


def _fits(req: PlanRequest, tp: int) -> bool:
    try:
        return CostModel(req.model, req.hw, tp).kv_capacity_tokens() >= req.lengths.max_len
    except CostError:
        return False


def _search_mode(req: PlanRequest, trace, mode: str, tp: int) -> Plan | None:
    def run(layout: Layout) -> Plan:
        result = simulate(req, layout, trace)
        return Plan(layout, result, result.attainment(req.slo))

    if mode == "colocated":
        n = _smallest(lambda c: run(Layout(colocated=c, tp_decode=tp)).attainment >= req.attainment, req.max_workers)
        return None if n is None else run(Layout(colocated=n, tp_decode=tp))
    # prefill alone: TTFT only, with decode (2n + 2 workers) out of the way
    ttft_ok = dataclasses.replace(req, slo=Slo(req.slo.ttft_s, math.inf))
    p = _smallest(lambda n: _attained(ttft_ok, Layout(n, 2 * n + 2, 0, tp, tp), trace), req.max_workers)
    if p is None:
        return None
    # decode with that prefill pool; if both SLOs together miss at any decode size, grow prefill
    for p_try in range(p, p + 4):
        d = _smallest(lambda n: run(Layout(p_try, n, 0, tp, tp)).attainment >= req.attainment, limit=req.max_workers)
        if d is not None:
            return run(Layout(p_try, d, 0, tp, tp))
    return None

def _attained(req: PlanRequest, layout: Layout, trace) -> bool:
    return simulate(req, layout, trace).attainment(req.slo) >= req.attainment


def _smallest(ok: Callable[[int], bool], limit: int) -> int | None:
    """The smallest n in [1, limit] with ok(n), assuming ok is monotone: doubling, then bisection."""
    hi = 1
    while not ok(hi):
        if hi >= limit:
            return None
        hi = min(hi * 2, limit)
    lo = hi // 2  # ok(lo) is False (or lo == 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi
