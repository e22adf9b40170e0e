"""``pdserve serve --layout auto``: the layout this machine serves best, chosen at start by
simulation (DistServe's placement by simulation, done where the user is).

Each candidate layout the machine's cores can run, one worker per core (every fixed split
kP:(N-k)D, N colocated workers, and elastic roles starting from the even split, free to make
a decode worker mixed), is simulated on this machine's CPU profile (the cost of a step on the
kernel path the workers will run) at rising Poisson rates of the objective's workload, each as
``pdserve serve`` would run it (``spec_for``: disaggregated and
elastic candidates with prefill that keeps up at half the TTFT objective and decode workers'
mixed steps aimed at half the TPOT objective; colocated ones with neither, as serve leaves
them). A candidate's predicted goodput is the highest rate at which at least
``attainment`` of the requests meet both the TTFT and the TPOT objective (bisection on the
rate, to ``RATE_RESOLUTION``). The highest wins, unless it beats the default layout (the
even split: 1P:1D on two cores, what ``make serve`` started before this choice existed) by
no more than ``margin``: then the default stays.

Where the profile comes from (planner/calibration.py): measured here at the first start (a
short ``pdserve profile`` fit on CPU time, about 15 s) and cached per processor model, kernel
path, dtype and build, so later starts read it; a simulation over it takes well under a second
per candidate.
A stored profile fitted on another machine (``profiles/cpu-<path>.json``, the path the workers
will run, read from ``PDSERVE_CPU_ISA`` or the processor's flags without loading the kernels;
else ``cpu.json``) stands in only where measuring is impossible, and predicts that machine's
goodput (issue 59: 3.15 req/s predicted from the EPYC's, 1.4 served on an Intel Xeon). The log
names the file, whether it was measured now, cached or stored, and its source.

Why a correction and a margin: the simulator's goodput still differs from a served run's, by
layout kind. Each prediction is multiplied by its kind's factor (``SERVED_OVER_SIMULATED``)
before the comparison: served over simulated goodput for each kind, the served 90% crossings
on the AMD EPYC with AVX-512 BF16 (BENCHMARKS.md, 2026-11-28: 1P:1D 3.16, two colocated workers
3.10, elastic roles 3.14 req/s) over the simulator's on that path's own fitted profile
(``profiles/cpu-avx512_bf16.json``: 3.62, 3.19, 3.62). Before the simulator modelled prefill
that keeps up and time-sized chunks, the factors were far apart (1.19, 0.75 and 1.31 on the AMX
Xeon, on a profile of another path): the simulator then missed what made disaggregated and
elastic layouts serve more. The same factors on the emulated ``avx2`` path, whose served
1P:1D is 1.07 req/s against 1.38 simulated, predict it 12% high. The elastic factor is the
least certain: over a longer load (96 prompts a rate, not 48) elastic roles served 1.40 req/s,
not 3.14, while 1P:1D held 3.12. Even served, these layouts swapped places
between runs on one machine by up to about 15% (the same page: elastic roles 0.89-1.07x the best
fixed layout in four runs, the best fixed one alternating between 1P:1D and colocated), so a
candidate must beat the default by more than ``DEFAULT_MARGIN`` to replace it: within it, the
layout every test and benchmark before this choice ran keeps its place.

Pure apart from the simulation: plain values in, a ``LayoutChoice`` out; ``choose_for_settings``
is the adapter ``pdserve serve`` calls with its resolved settings.
"""

from __future__ import annotations

import dataclasses

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from pdserve.cluster.mode import COLOCATED, DISAGGREGATED
from pdserve.planner.hardware import DEFAULT_CPU_PROFILE, HardwareProfile
from pdserve.planner.layout import ClusterSpec, Layout
from pdserve.planner.metrics import SimResult, Slo
from pdserve.planner.model_spec import ModelSpec
from pdserve.planner.synthetic import LengthMix, poisson

if TYPE_CHECKING:
    from pdserve.engine.config import CacheConfig

DEFAULT_MARGIN = 0.15  # a candidate must beat the default's predicted goodput by more than this share
# Served goodput over simulated, per layout kind, from one served comparison (module docstring):
# 3.16 / 3.62 (1P:1D), 3.10 / 3.19 (colocated 2), 3.14 / 3.62 (elastic from 1P:1D).
SERVED_OVER_SIMULATED = {"disaggregated": 0.87, "colocated": 0.97, "elastic": 0.87}
RATE_RESOLUTION = 0.02  # bisection stops when the bracket is within 2% of its upper end
MAX_WORKERS = 8  # one worker per core up to this; more cores give each worker several threads
DEFAULT_SLO = Slo(ttft_s=2.0, tpot_s=0.1)  # issue 45's objectives
DEFAULT_LENGTHS = LengthMix(256, 64)  # the serving benchmark's workload: 256 prompt, 64 output tokens


@dataclass(frozen=True)
class Objective:
    """What the chosen layout should serve best: requests of ``lengths`` meeting ``slo``, at
    ``attainment``; ``requests`` simulated per rate tried (more is steadier and slower)."""

    slo: Slo = DEFAULT_SLO
    lengths: LengthMix = DEFAULT_LENGTHS
    attainment: float = 0.9
    requests: int = 300
    seed: int = 0


@dataclass(frozen=True)
class Candidate:
    name: str  # as the log shows it, e.g. "1P:1D", "2C", "elastic from 1P:1D"
    layout: Layout
    elastic: bool = False

    @property
    def kind(self) -> str:
        """``SERVED_OVER_SIMULATED``'s key: disaggregated, colocated or elastic."""
        return "elastic" if self.elastic else ("colocated" if self.layout.colocated else "disaggregated")

    def settings(self) -> dict[str, Any]:
        """The ``pdserve serve`` settings that run this layout."""
        if self.layout.colocated:
            return {"mode": COLOCATED, "decode": self.layout.colocated, "elastic_roles": False, "role_budget": False}
        return {"mode": DISAGGREGATED, "prefill": self.layout.prefill, "decode": self.layout.decode,
                "elastic_roles": self.elastic, "role_budget": self.elastic}


@dataclass(frozen=True)
class Prediction:
    candidate: Candidate
    simulated: float  # the simulator's goodput, req/s
    factor: float  # its kind's served over simulated goodput (``SERVED_OVER_SIMULATED``)

    @property
    def goodput(self) -> float:
        """The predicted served goodput, req/s."""
        return self.simulated * self.factor


@dataclass(frozen=True)
class LayoutChoice:
    chosen: Candidate
    default: Candidate
    predictions: tuple[Prediction, ...]  # every candidate's, the default first
    reason: str

    def lines(self) -> list[str]:
        """What ``pdserve serve`` logs: each candidate's predicted goodput, then the choice and why."""
        out = [f"{p.candidate.name:<22} predicted goodput {p.goodput:6.2f} req/s (simulated {p.simulated:.2f} x "
               f"{p.factor:.2f} served/simulated for {p.candidate.kind})" for p in self.predictions]
        return out + [f"chose {self.chosen.name}: {self.reason}"]


def candidates(cores: int) -> list[Candidate]:
    """The layouts ``cores`` cores run, one worker a core (at least two, at most ``MAX_WORKERS``):
    every kP:(N-k)D split, N colocated, elastic roles from the even split. The first is the default."""
    n = max(2, min(cores, MAX_WORKERS))
    default = _split(n // 2, n - n // 2)
    fixed = [_split(k, n - k) for k in range(1, n) if k != n // 2]
    elastic = Candidate(f"elastic from {default.name}", default.layout, elastic=True)
    return [default, *fixed, Candidate(f"{n}C", Layout(colocated=n)), elastic]


def _split(p: int, d: int) -> Candidate:
    return Candidate(f"{p}P:{d}D", Layout(prefill=p, decode=d))


def simulate(model: ModelSpec, hw: HardwareProfile, candidate: Candidate, rate: float,
             objective: Objective) -> SimResult:
    """One candidate at one Poisson rate of the objective's workload."""
    from pdserve.planner.cost import CostModel
    from pdserve.planner.elastic import ElasticDriver
    from pdserve.planner.simulator import Simulator

    trace = poisson(rate, objective.requests / rate, objective.lengths, objective.seed)
    cost = CostModel(model, hw, 1)
    driver = ElasticDriver() if candidate.elastic else None
    return Simulator(spec_for(candidate, cost, objective.slo), trace, autoscaler=driver).run()


def spec_for(candidate: Candidate, cost, slo: Slo) -> ClusterSpec:
    """The simulated cluster as ``pdserve serve`` would run the candidate for ``slo``: the
    overflow threshold and the step target its settings derive from the objectives
    (``pdserve.cluster.serve_config``; for a colocated layout no step target, and with no
    prefill pool the overflow never applies)."""
    from pdserve.cluster.serve_config import mixed_step_target_s, overflow_s
    from pdserve.router.local_prefill import LocalPrefillConfig

    v = {**candidate.settings(), "mixed_step_target_s": None, "prefill_overflow_s": None,
         "layout_ttft_slo_s": slo.ttft_s, "layout_tpot_slo_s": slo.tpot_s}
    return ClusterSpec(candidate.layout, cost, cost, overflow_ttft_s=overflow_s(v),
                       overflow_slowdown=LocalPrefillConfig.overflow_slowdown, step_target_s=mixed_step_target_s(v))


def predicted_goodput(meets: Callable[[float], bool], start: float = 0.25, limit: float = 1e4) -> float:
    """The highest rate at which ``meets(rate)`` holds (doubling from ``start``, then bisection
    to ``RATE_RESOLUTION``); 0 where not even ``start`` / 2**6 does. ``meets`` is taken as
    monotone: the simulator's attainment falls with the rate, up to noise."""
    lo, hi = 0.0, start
    while meets(hi):
        lo, hi = hi, hi * 2
        if hi > limit:
            return lo
    if lo == 0.0:  # even ``start`` misses: look below it, a few halvings
        for _ in range(6):
            hi /= 2
            if meets(hi):
                lo, hi = hi, hi * 2
                break
        else:
            return 0.0
    while hi - lo > RATE_RESOLUTION * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if meets(mid) else (lo, mid)
    return lo


def decide(simulated: list[tuple[Candidate, float]], margin: float = DEFAULT_MARGIN,
           factors: dict[str, float] = SERVED_OVER_SIMULATED) -> LayoutChoice:
    """Each simulated goodput times its kind's served/simulated factor; the highest wins, unless
    it is within ``margin`` of the default's (the first candidate's): then the default stays.
    Ties go to the earlier candidate."""
    predictions = tuple(Prediction(c, raw, factors.get(c.kind, 1.0)) for c, raw in simulated)
    default = predictions[0]
    best = max(predictions, key=lambda p: p.goodput)  # max keeps the first of equal ones
    top, base = best.goodput, default.goodput
    if best is default:
        reason = f"the highest predicted goodput ({top:.2f} req/s)"
    elif top <= base * (1 + margin):
        reason = (f"{best.candidate.name} predicts {top:.2f} req/s, within {margin:.0%} of the default's "
                  f"{base:.2f}: too close to tell apart; the default stays")
        best = default
    else:
        reason = (f"the highest predicted goodput ({top:.2f} req/s), more than {margin:.0%} above the "
                  f"default {default.candidate.name}'s {base:.2f}")
    return LayoutChoice(best.candidate, default.candidate, predictions, reason)


def choose(model: ModelSpec, hw: HardwareProfile, cores: int, objective: Objective = Objective(),
           margin: float = DEFAULT_MARGIN) -> LayoutChoice:
    """Every candidate for ``cores`` simulated, its goodput predicted, and the choice."""
    def goodput(c: Candidate) -> float:
        return predicted_goodput(lambda r: simulate(model, hw, c, r, objective).attainment(objective.slo)
                                 >= objective.attainment)

    return decide([(c, goodput(c)) for c in candidates(cores)], margin)


def kernel_path() -> str | None:
    """The CPU kernel path the workers will run (``PDSERVE_CPU_ISA``, else the fastest this
    processor's flags allow), read without loading the kernels; None without AVX2."""
    from pdserve.engine.kernels.cpu_kernels import ISA_FLAGS, ISAS, cpu_flags, requested_isa

    wanted = requested_isa()
    if wanted is not None:
        return wanted
    have = set(cpu_flags())
    runs = [name for name in ISAS if set(ISA_FLAGS[name]) <= have]
    return runs[-1] if runs else None


def profile_for(path: str | None, directory: Path = DEFAULT_CPU_PROFILE.parent) -> Path:
    """The stored profile of kernel path ``path`` (``cpu-<path>.json``, as ``pdserve profile
    --output`` writes one per processor kind) where there is one, else the default ``cpu.json``."""
    specific = directory / f"cpu-{path}.json"
    return specific if path is not None and specific.exists() else directory / DEFAULT_CPU_PROFILE.name


def on_this_host(hw: "HardwareProfile", cores: int, need_bytes: float, host_bytes: float | None = None
                 ) -> "HardwareProfile":
    """A CPU profile's worker memory as this host gives it: what a worker needs (``need_bytes``:
    its weights and its KV cache setting), where this host's RAM (``host_bytes``, read if None)
    shared by as many workers as it has cores holds that, else the share it has. A stored
    profile holds the memory of the machine it was measured on (a 135M model and 1 GiB of KV),
    which refused a 1B checkpoint on a 24 GiB host. A GPU profile's is the device's own."""
    if hw.overlap:
        return hw
    if host_bytes is None:
        host_bytes = _host_ram()
    return dataclasses.replace(hw, mem_bytes=min(need_bytes, host_bytes / max(1, cores)))


def worker_need_bytes(weight_bytes: float, cache: "CacheConfig | None", host_bytes: float | None = None) -> float:
    """What one worker holds in memory with the KV cache ``cache`` sizes (None: the default
    one): its weights and an exact KV budget; for a share of the host (``gpu_memory_utilization``,
    what the worker measures only once started), that share of its RAM (``host_bytes``, read if
    None), which holds weights, activations and KV together."""
    from pdserve.engine.config import DEFAULT_KV_CACHE_BYTES

    exact = DEFAULT_KV_CACHE_BYTES if cache is None else cache.exact_budget_bytes()
    if exact is not None:
        return weight_bytes + exact
    if host_bytes is None:
        host_bytes = _host_ram()
    return cache.gpu_memory_utilization * host_bytes


def _host_ram() -> int:
    """This host's RAM, read as a CPU worker reads it for its share (``engine.memory.HostMemory``)."""
    from pdserve.engine.memory import HostMemory

    return HostMemory().total_bytes()


def choose_for_settings(v: dict[str, Any], announce: Callable[[str], None] | None = None
                        ) -> tuple[dict[str, Any], list[str]]:
    """``pdserve serve``'s resolved settings ``v`` -> (the settings of the chosen layout, empty
    where the default wins; the log lines saying what was compared on what and why). A model or
    profile the planner cannot read leaves the layout as it is, said so. ``v["kv_cache"]``: the
    workers' ``CacheConfig`` (absent: the default KV cache); ``v["dtype"]``: the serving dtype
    (absent or None: bfloat16), the one this machine is measured in. ``announce``: hears, before
    it starts, that this machine is being measured (default: printed as serve's log lines are)."""
    from pdserve.planner.calibration import resolve
    from pdserve.planner.hardware import ProfileError
    from pdserve.planner.model_spec import ModelSpecError, get_model

    from pdserve.planner.cost import CostError

    path = kernel_path()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    try:
        model = get_model("SmolLM2-135M" if v["model"] == "default" else v["model"])  # before any measuring
        resolved = resolve(path, v.get("dtype"), profile_for, announce=announce or _print_layout_line)
        hw = resolved.profile
        hw = on_this_host(hw, cores, worker_need_bytes(model.weight_bytes(hw.dtype_bytes), v.get("kv_cache")))
    except (ProfileError, ModelSpecError) as exc:
        return {}, [f"no prediction ({exc}); the default layout stays"]
    objective = Objective(Slo(v["layout_ttft_slo_s"], v["layout_tpot_slo_s"]),
                          LengthMix(v["layout_prompt_tokens"], v["layout_output_tokens"]))
    try:
        choice = choose(model, hw, cores, objective)
    except CostError as exc:  # start-up never refuses what the default layout may serve
        return {}, [f"no prediction ({exc}); the default layout stays"]
    # The default candidate stands for ``make serve``'s own layout, 1P:1D with the cores split
    # between the two (the profile is one thread's: the even split of one-core workers is its
    # stand-in); where it wins, nothing changes.
    chosen = {} if choice.chosen is choice.default else choice.chosen.settings()
    head = (f"{cores} core(s), kernel path {path}, {model.name}, objectives TTFT <= {objective.slo.ttft_s:g} s and "
            f"TPOT <= {objective.slo.tpot_s * 1e3:g} ms for {objective.attainment:.0%} of "
            f"{objective.lengths.prompt_mean}/{objective.lengths.output_mean}-token requests")
    return chosen, [head, f"{resolved.line()}: {hw.source[:96]}...", *choice.lines()]


def _print_layout_line(line: str) -> None:
    print(f"pdserve: layout auto: {line}", flush=True)
