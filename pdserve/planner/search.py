"""``pdserve plan``: the fewest GPUs that serve a rate at an SLO attainment.

For each tensor-parallel degree the engine runs the model at (``pdserve.planner.tp``: the
engine's own split rule; a degree it refuses, or whose weights leave no room for one request's
KV, is skipped with the reason) the search finds the smallest prefill pool that keeps TTFT
within its SLO with decode not the bottleneck, then the smallest decode pool with that prefill
pool, then grows whichever pool helps more until the attainment is met (exponential then
binary search per pool; the simulator's answer is close to monotone in each pool's size).
Colocated layouts are searched the same way, and the cheaper layout wins.

By default both pools of a disaggregated layout run at the same degree. With per-pool choices
(``--prefill-tp``, ``--decode-tp``) every pair is searched where one size divides the other
(what the KV transfer moves by head): prefill may run wide for a short TTFT and decode narrow
with more replicas.
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
from pdserve.planner.synthetic import LengthMix, poisson, shared_prefix
from pdserve.planner.trace import TraceRequest
from pdserve.planner.tp import pair_refusal, tp_refusal
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
    tp_choices: tuple[int, ...] = (1, 2, 4, 8)  # colocated, and both pools unless given apart below
    prefill_tp_choices: tuple[int, ...] | None = None  # a disaggregated layout's prefill pool; None: tp_choices
    decode_tp_choices: tuple[int, ...] | None = None  # and its decode pool
    num_requests: int = 3000  # simulated per candidate; more is steadier and slower
    min_duration_s: float = 60.0
    limits: EngineLimits = dataclasses.field(default_factory=EngineLimits)
    modes: tuple[str, ...] = ("disaggregated", "colocated")
    seed: int = 0
    max_workers: int = 1024  # per pool: the search gives up beyond this
    replay: tuple[TraceRequest, ...] | None = None  # a recorded trace instead of Poisson arrivals
    # Poisson prompts after one of ``num_prefixes`` shared prefixes of ``prefix_tokens`` tokens
    # (``synthetic.shared_prefix``, ``prefix_order`` "random" or "cyclic"); 0: no shared prefix.
    num_prefixes: int = 0
    prefix_tokens: int = 0
    prefix_order: str = "random"
    kv_offload_bytes: int = 0  # each host's KV tier below the prefix cache (ClusterSpec); 0: none

    def __post_init__(self) -> None:
        if self.rate <= 0:
            raise PlanError("rate", f"must be > 0, got {self.rate}")
        if not 0 < self.attainment <= 1:
            raise PlanError("attainment", f"must be within (0, 1], got {self.attainment}")
        if (self.num_prefixes > 0) != (self.prefix_tokens > 0) or min(self.num_prefixes, self.prefix_tokens) < 0:
            raise PlanError("prefixes", f"num_prefixes and prefix_tokens: both >= 1 or both 0, got "
                                        f"{self.num_prefixes} and {self.prefix_tokens}")
        if self.kv_offload_bytes < 0:
            raise PlanError("kv_offload_bytes", f"must be >= 0 (0: no KV tier), got {self.kv_offload_bytes}")

    def trace(self) -> list[TraceRequest]:
        if self.replay is not None:
            return list(self.replay)
        duration = max(self.min_duration_s, self.num_requests / self.rate)
        if self.num_prefixes:
            return shared_prefix(self.rate, duration, self.lengths, self.num_prefixes, self.prefix_tokens,
                                 self.seed, self.prefix_order)
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
    return Simulator(ClusterSpec(layout, cost_p, cost_d, req.limits, kv_offload_bytes=req.kv_offload_bytes),
                     trace).run()


def plan(req: PlanRequest, progress: Callable[[str], None] = lambda _: None) -> Plan:
    """The cheapest layout found; ties go to the higher attainment. ``progress`` hears each
    candidate's best layout ("tried ...") and each degree or pair skipped, with why ("skipped ...")."""
    trace = req.trace()
    best: Plan | None = None
    for mode, tp_p, tp_d in _candidates(req, progress):
        found = _search_mode(req, trace, mode, tp_p, tp_d)
        if found is None:
            continue
        progress(f"tried {_tp_name(tp_p, tp_d)} {mode}: {found.layout.describe()} = {found.gpus} GPUs, "
                 f"attainment {found.attainment:.3f}")
        if best is None or (found.gpus, -found.attainment) < (best.gpus, -best.attainment):
            best = found
    if best is None:
        raise PlanError("rate", f"no layout of up to {req.max_workers} workers per pool serves {req.rate} req/s at "
                                f"{req.attainment:.0%} attainment of TTFT {req.slo.ttft_s} s / TPOT {req.slo.tpot_s} s")
    return best


def _tp_name(tp_p: int, tp_d: int) -> str:
    return f"TP{tp_p}" if tp_p == tp_d else f"prefill TP{tp_p} / decode TP{tp_d}"


def _candidates(req: PlanRequest, progress: Callable[[str], None]) -> list[tuple[str, int, int]]:
    """(mode, prefill TP, decode TP) to search, in order; the degrees and pairs left out are
    reported through ``progress`` with the reason."""
    usable: dict[int, bool] = {}

    def ok(tp: int) -> bool:
        if tp not in usable:
            why = tp_unusable(req, tp)
            if why:
                progress(f"skipped TP{tp}: {why}")
            usable[tp] = why is None
        return usable[tp]

    split = req.prefill_tp_choices is not None or req.decode_tp_choices is not None
    out = []
    if split and "disaggregated" in req.modes:
        for tp_p in req.prefill_tp_choices or req.tp_choices:
            for tp_d in req.decode_tp_choices or req.tp_choices:
                if ok(tp_p) and ok(tp_d):
                    why = pair_refusal(tp_p, tp_d)
                    if why:
                        progress(f"skipped {_tp_name(tp_p, tp_d)}: {why}")
                    else:
                        out.append(("disaggregated", tp_p, tp_d))
    for tp in req.tp_choices:
        out.extend((mode, tp, tp) for mode in req.modes if not (split and mode == "disaggregated") and ok(tp))
    return out


def tp_unusable(req: PlanRequest, tp: int) -> str | None:
    """Why a worker of ``tp`` ranks cannot serve ``req``: the engine refuses the degree, or
    the weights leave no KV room for one request of the longest length; None where it can."""
    why = tp_refusal(req.model, tp)
    if why:
        return why
    if req.kv_offload_bytes and tp > 1:  # the engine's refusal (ClusterSpec says it too)
        return "the KV tier (--kv-offload-bytes) runs at TP1 only"
    try:
        room = CostModel(req.model, req.hw, tp).kv_capacity_tokens()
    except CostError as exc:
        return exc.problem
    if room < req.lengths.max_len:
        return f"KV room for {room} tokens beside the weights, fewer than one request's {req.lengths.max_len}"
    return None


def _search_mode(req: PlanRequest, trace, mode: str, tp_p: int, tp_d: int) -> Plan | None:
    def run(layout: Layout) -> Plan:
        result = simulate(req, layout, trace)
        return Plan(layout, result, result.attainment(req.slo))

    if mode == "colocated":
        n = _smallest(lambda c: run(Layout(colocated=c, tp_decode=tp_d)).attainment >= req.attainment,
                      req.max_workers)
        return None if n is None else run(Layout(colocated=n, tp_decode=tp_d))
    # prefill alone: TTFT only, with decode (2n + 2 workers) out of the way
    ttft_ok = dataclasses.replace(req, slo=Slo(req.slo.ttft_s, math.inf))
    p = _smallest(lambda n: _attained(ttft_ok, Layout(n, 2 * n + 2, 0, tp_p, tp_d), trace), req.max_workers)
    if p is None:
        return None
    # decode with that prefill pool; if both SLOs together miss at any decode size, grow prefill
    for p_try in range(p, p + 4):
        d = _smallest(lambda n: run(Layout(p_try, n, 0, tp_p, tp_d)).attainment >= req.attainment,
                      limit=req.max_workers)
        if d is not None:
            return run(Layout(p_try, d, 0, tp_p, tp_d))
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
