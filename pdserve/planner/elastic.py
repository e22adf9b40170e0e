"""Elastic roles in the simulator: the real budget policy (``pdserve.cluster.autoscaling.budget``)
moving workers between a disaggregated layout's pools, its worker count fixed.

Once a second (``interval_s``) the driver samples both pools as ``pdserve.planner.autoscale``
does (the same sample functions: prefill queued prompt tokens and TTFT p90 of the first tokens
since the last sample; decode KV usage and ITL p90), keeps each pool's trailing window and
calls ``decide_roles``. A half move (decode <-> mixed) switches a decode worker in place
(``Simulator.switch_in_place``: its streams stay, only its routing changes). A whole move
drains the donor's least loaded worker (out of routing at once; what it holds finishes: prompts
are prefilled and their KV sent; a decode worker's streams run until the policy's grace, then
move with their KV to the rest of the pool, ``Simulator.hand_over``) and, at the first tick
that finds it idle, the worker serves the other role ``switch_s`` later (a role switch loads no
model: tens of milliseconds measured, docs/elastic-roles.md).

Differences from a served cluster, each erring against elastic roles: a worker changes role
and hands its streams over only at a tick (up to ``interval_s`` late), and the worker's prefix
cache starts empty in its new role. Erring for them: a moved stream's wait for its KV is not
counted in its ITL.
"""

from __future__ import annotations

from collections import deque

from pdserve.cluster.autoscaling import MetricsWindow, PoolPolicyConfig, PoolSample, pool_config
from pdserve.cluster.autoscaling.budget import POOLS, BudgetConfig, RoleMove, decide_roles
from pdserve.planner.autoscale import AutoscaleDriver
from pdserve.planner.simulator import READY


class ElasticDriver:
    def __init__(self, config: BudgetConfig = BudgetConfig(), targets: dict[str, PoolPolicyConfig] | None = None,
                 interval_s: float = 1.0, switch_s: float = 0.05):
        self.config = config
        self.targets = targets or {pool: pool_config(pool) for pool in POOLS}
        self.interval_s = interval_s
        self.switch_s = switch_s
        self._samples: dict[str, deque[PoolSample]] = {pool: deque() for pool in POOLS}
        self._moving = None  # (worker draining, its move, when decided)
        self._decided: float | None = None  # when the switch under way was decided
        self.last_switch_t: float | None = None
        self.switches: list[tuple[float, float, str, str]] = []  # (decided, serving, donor, taker)
        self.moves: list[tuple[float, RoleMove]] = []  # every decision that computed pressures
        # pool -> [(t, ready workers, ready workers, pressure)]: AutoscaleDriver.history's shape, for plots
        self.history: dict[str, list[tuple[float, int, int, float]]] = {pool: [] for pool in POOLS}
        self.mixed_history: list[tuple[float, int]] = []  # (t, decode workers in the mixed role)

    def tick(self, sim, now: float) -> None:
        samples = {"prefill": AutoscaleDriver._prefill_sample(sim, now),
                   "decode": AutoscaleDriver._decode_sample(sim, now)}
        sim.recent_ttft.clear()
        sim.recent_itl.clear()
        for pool in POOLS:
            window = self._samples[pool]
            window.append(samples[pool])
            while len(window) > 2 and window[1].t <= now - self.config.window_s:
                window.popleft()  # keep the one sample at or before the window's start
        if self._moving is not None:
            worker, move, decided = self._moving
            if move.donor == "decode" and worker.running and now - decided >= self.config.grace_s:
                sim.hand_over(worker)  # past the grace: its streams move with their KV
            if worker.idle():
                self._moving = None
                sim.schedule(now + self.switch_s, READY, (self, move.taker))  # it serves its new role
            self._record(now, None, len(sim.mixed))
            return
        windows = {pool: MetricsWindow(tuple(self._samples[pool])) for pool in POOLS}
        move = decide_roles(windows, self.targets, self.config, self.last_switch_t, now, mixed=len(sim.mixed))
        if move.pressures:
            self.moves.append((now, move))
        if move.taker is not None and move.from_role is not None:  # a half move: in place, nothing drains
            if sim.switch_in_place(move.target) is not None:
                self.last_switch_t = now + self.switch_s
                self.switches.append((now, now + self.switch_s, move.source, move.target))
        elif move.taker is not None:
            worker = sim.drain_worker(move.donor)
            if worker is not None:
                self._moving, self._decided = (worker, move, now), now
        self._record(now, move, len(sim.mixed))

    def worker_ready(self, sim, pool: str) -> None:
        """The drained worker serves ``pool`` now (the simulator's READY event)."""
        sim.add_worker(pool)
        self.last_switch_t = sim.now
        donor = "decode" if pool == "prefill" else "prefill"
        self.switches.append((self._decided, sim.now, donor, pool))

    def _record(self, now: float, move: RoleMove | None, mixed: int) -> None:
        pressure = {p.pool: p.mean for p in move.pressures} if move is not None and move.pressures else {}
        for pool in POOLS:
            ready = self._samples[pool][-1].replicas
            last = self.history[pool][-1][3] if self.history[pool] else 0.0
            self.history[pool].append((now, ready, ready, pressure.get(pool, last)))
        self.mixed_history.append((now, mixed))


def compare_layouts(req, trace, start, driver: ElasticDriver | None = None,
                    progress=lambda name: None) -> list[tuple[str, object]]:
    """Every fixed split of ``start``'s workers (kP:(N-k)D, and N colocated) and elastic roles
    starting from ``start`` (``driver``, default ``ElasticDriver()``), each simulated over
    ``trace``: [(name, SimResult)], elastic last. ``req`` is the ``PlanRequest`` (model,
    hardware, limits); TP as in ``start``. ``progress`` hears each layout's name as it starts."""
    from pdserve.planner.cost import CostModel
    from pdserve.planner.layout import ClusterSpec, Layout
    from pdserve.planner.simulator import Simulator

    if start.colocated or start.prefill < 1 or start.decode < 1:
        raise ValueError(f"--layout: elastic roles start from a disaggregated layout like 1P:2D, got {start.describe()}")
    workers = start.prefill + start.decode
    tp_p, tp_d = start.tp_prefill, start.tp_decode
    fixed = [Layout(k, workers - k, 0, tp_p, tp_d) for k in range(1, workers)]
    if tp_p == tp_d:
        fixed.append(Layout(colocated=workers, tp_decode=tp_d))
    out = []
    for layout in fixed + [start]:
        spec = ClusterSpec(layout, CostModel(req.model, req.hw, layout.tp_prefill),
                           CostModel(req.model, req.hw, layout.tp_decode), req.limits,
                           kv_offload_bytes=req.kv_offload_bytes)
        elastic = layout is start  # the last run: the same start, roles free to move
        name = f"elastic from {layout.describe()}" if elastic else layout.describe()
        progress(name)
        result = Simulator(spec, trace, autoscaler=(driver or ElasticDriver()) if elastic else None).run()
        out.append((name, result))
    return out
