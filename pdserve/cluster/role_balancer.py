"""The budget loop: with a fixed number of elastic workers, move one between the prefill and the
decode pool when the budget policy says so (``pdserve.cluster.autoscaling.budget``).

Every ``interval_s`` the loop samples both pools as the autoscaler does (the same
``sample_pool``: live workers' stats and the router's TTFT and ITL p90 since the last round),
keeps the trailing window, and asks ``decide_roles``. A move switches the donor pool's least
loaded worker in place (``pdserve.cluster.roles.switch_role``: out of its pool, drained within
``grace_s``, into the other) on a thread of its own, so sampling goes on; no new decision is
taken while it runs, and the window starts over once it is done (the policy's settling guard).
A half move (decode <-> mixed) switches a worker of its ``source`` role, and changes no pool.
The switch's reason is the policy's label (``prefill_pressure`` or ``decode_pressure``); the
router counts it in ``pdserve:role_changes_total`` and shows each pool's pressure in
``pdserve:role_budget_pressure``.

Beside per-pool autoscaling: the autoscaler still grows or shrinks a pool where its bounds let
it; the budget loop waits while one of its changes is under way, and tells it of each move so
that its desired counts follow the pools.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from pdserve.cluster.autoscaler import _stats, router_latency, sample_pool
from pdserve.cluster.autoscaling import MetricsWindow, PoolPolicyConfig, PoolSample
from pdserve.cluster.autoscaling.budget import POOLS, BudgetConfig, RoleMove, decide_roles, pressure
from pdserve.cluster.round_loop import RoundLoop
from pdserve.elastic_worker.roles import POOL

log = logging.getLogger(__name__)


class RoleBalancer(RoundLoop):
    name = "role-balancer"

    def __init__(self, cluster, config: BudgetConfig, targets: dict[str, PoolPolicyConfig], interval_s: float = 1.0,
                 grace_s: float | None = None, history: int = 3600):
        """``grace_s``: each switch's drain grace; None: the config's (``BudgetConfig.grace_s``)."""
        super().__init__(interval_s)
        self.cluster = cluster
        self.config = config
        self.targets = targets
        self.grace_s = config.grace_s if grace_s is None else grace_s
        self.samples: dict[str, deque[PoolSample]] = {pool: deque(maxlen=history) for pool in POOLS}
        self.moves: deque[tuple[float, RoleMove]] = deque(maxlen=history)  # every decision, holds included
        self.switches: list = []  # each completed switch (pdserve.cluster.roles.RoleSwitch)
        self.last_switch_t: float | None = None
        self._pressures: dict[str, float] = {}
        self._switch: threading.Thread | None = None
        self._last_round: float | None = None
        self._hold_logged: float | None = None  # when a hold under pressure was last logged

    def stop(self, join_s: float = 60.0) -> None:
        super().stop(join_s)
        if self._switch is not None:
            self._switch.join(join_s + self.grace_s)

    def pressures(self) -> dict[str, float]:
        """Each pool's pressure (mean over the trailing window, however short) as of the last
        round (read by ``push_membership`` on other threads: a dict replaced whole, never
        changed in place)."""
        return self._pressures

    def round(self) -> None:
        self.step(time.monotonic())

    def step(self, now: float) -> RoleMove | None:
        """One round: sample, decide, start a switch. None while a switch or a scale change runs."""
        since, self._last_round = self._last_round, now
        latency = router_latency(self.cluster, now - since if since is not None else self.interval_s)
        for pool in POOLS:
            self.samples[pool].append(sample_pool(self.cluster, pool, now, latency))
        windows = {pool: MetricsWindow.trailing(list(self.samples[pool]), now, self.config.window_s) for pool in POOLS}
        # exported every round, whatever holds the decision: a dashboard shows the pressure building
        self._pressures = {pool: pressure(pool, windows[pool], self.targets[pool]).mean for pool in POOLS}
        autoscaler = getattr(self.cluster, "autoscaler", None)
        if (self._switch is not None and self._switch.is_alive()) or (autoscaler is not None and autoscaler.pending()):
            return None
        move = decide_roles(windows, self.targets, self.config, self.last_switch_t, now, mixed=len(self.cluster.mixed))
        self.moves.append((now, move))
        if move.taker is None:
            self._log_hold(now, move)
            return move
        address = self._least_loaded(move)
        if address is None:
            return move
        log.info("role balancer: %s; switching %s", move.reason, address)
        self._switch = threading.Thread(target=self._apply, args=(address, move), name="pdserve-role-switch",
                                        daemon=True)
        self._switch.start()
        return move

    def _log_hold(self, now: float, move: RoleMove) -> None:
        """A hold while a pool is over ``high`` is logged (once a window at most): why a pressed
        pool got no worker is what an operator, or a benchmark's log, needs to read afterwards.
        Other holds are debug."""
        pressed = any(p.mean > self.config.high for p in move.pressures)
        if pressed and (self._hold_logged is None or now - self._hold_logged >= self.config.window_s):
            self._hold_logged = now
            log.info("role balancer: %s", move.reason)
        else:
            log.debug("role balancer: %s", move.reason)

    def _least_loaded(self, move: RoleMove) -> str | None:
        """The worker with the least to hand over among those the move may switch (a whole move:
        the donor pool's, mixed ones included; a half move: those in its ``source`` role): fewest
        queued prompt tokens (prefill) or KV blocks in use (decode)."""
        pool, loads = move.donor if move.from_role is None else POOL[move.source], []
        with self.cluster.lock:
            addresses = [a for a in self.cluster.addresses(pool)
                         if move.from_role is None or self.cluster.role_of(a) == move.source]
        for address in addresses:
            stats = _stats(pool, address, self.cluster.config.tls_for("controller"))
            if stats is not None:
                loads.append((stats.num_waiting_tokens if pool == "prefill" else stats.num_blocks_used, address))
        return min(loads)[1] if loads else None

    def _apply(self, address: str, move: RoleMove) -> None:
        try:
            switch = self.cluster.set_role(address, move.target, self.grace_s, move.label)
        except Exception:  # back in its old pool (switch_role); the next window decides again
            log.exception("role balancer: switching %s to %s failed", address, move.target)
            switch = None
        self.last_switch_t = time.monotonic()  # a failed switch also waits out the dwell: no retry storm
        if switch is not None:
            self.switches.append(switch)
            autoscaler = getattr(self.cluster, "autoscaler", None)
            if autoscaler is not None and POOL[switch.previous] != POOL[switch.role]:  # a half move stays in its pool
                autoscaler.roles_moved(POOL[switch.previous], POOL[switch.role])
