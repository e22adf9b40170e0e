"""A cluster on Ray: the router and every worker are Ray actors, each its own process.

``LocalCluster(config).start()`` starts (or joins, with ``ray_address``) Ray, converts the
model once, starts the workers, then the router pointed at them, and returns the router's
address. ``stop()`` stops them in reverse order and shuts Ray down if it started it.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import time
import uuid

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pdserve.cluster.actors import ServerActor
from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.placement import PoolPlacement, remove, remove_orphan_groups, reserve
from pdserve.cluster.ray_start import local_ray_cpus, start_local_ray
from pdserve.cluster.roles import hand_over_to_retire, switch_role
from pdserve.cluster.settings import DRAIN_GRACE_SECONDS
from pdserve.cluster.slots import Slot, Slots
from pdserve.cluster.worker_drain import drain_worker
from pdserve.elastic_worker.roles import HAND_OVER_AFTER_S, POOL
from pdserve.wire.grpc_util import channel

log = logging.getLogger(__name__)

PUSH_TIMEOUT_S = 10.0  # one membership push to the router (``push_membership``), a round at most this long


class LocalCluster:
    """The controller's state and actions: it starts the router and the workers, replaces dead
    ones (``pdserve.cluster.supervisor``), scales pools (``pdserve.cluster.autoscaler``) and stops them all.

    ``detached``: every actor and placement group it makes outlives the process that runs it, and
    is named in the Ray namespace, so that a controller started again (``pdserve.cluster.controller``)
    finds them and takes them over (``adopt``) instead of starting the workers again."""

    def __init__(self, config: ClusterConfig, detached: bool = False):
        self.config = config
        self.detached = detached
        self.slots = Slots()  # the workers, pool by pool (pdserve.cluster.slots); these are its lists:
        self.prefill, self.decode = self.slots.actors["prefill"], self.slots.actors["decode"]
        self.prefill_addresses, self.decode_addresses = self.slots.addresses["prefill"], self.slots.addresses["decode"]
        self.mixed = self.slots.mixed  # elastic workers in the mixed role (their slots are the decode pool's)
        self.router = None
        self.address: str | None = None  # the router's public gRPC address
        self.http_address: str | None = None
        self.admin_address: str | None = None  # the router's internal plane (RouterAdmin)
        self._supervisor = None  # a cluster.supervisor.Supervisor
        self._router_config = None  # what restart_router starts again
        self.autoscaler = None
        self.role_balancer = None  # a cluster.role_balancer.RoleBalancer with role_budget
        self._templates: dict[str, tuple] = {}  # role -> (placement, config, threads) for new slots
        self._next_id = {"prefill": 0, "decode": 0}
        self.lock = threading.RLock()  # membership changes: scaling and the supervisor
        self._started_ray = False
        self._core_slots = itertools.count()  # which cores the next pinned worker gets

    def start(self) -> str:
        from pdserve.engine.loader import materialize

        cfg = self.config
        materialize(cfg.engine.model, progress=True)  # convert a GGUF once, before the workers race to
        if not ray.is_initialized():
            self._init_ray()
        threads = cfg.worker_threads()
        sizes = {"prefill": cfg.num_prefill, "decode": cfg.num_decode}
        placed = [(pool, self._place(pool, self._pool_placement(pool), cfg.worker_config(pool, i), threads))
                  for pool, size in sizes.items() for i in range(size)]
        starts = [slot[0].start.remote() for _, slot in placed]
        # The router's process starts and imports while the workers load their models (about
        # 1.5 s a cluster, measured in the tests' Ray); it is given its workers when it starts.
        self.router = self._router_actor(cfg.router_config((), ()))
        for (pool, slot), address in zip(placed, ray.get(starts)):
            self.slots.add(pool, *slot, address)  # all started at once: their models load side by side
        self._next_id.update(sizes)
        self._start_router(cfg.router_config(tuple(self.prefill_addresses), tuple(self.decode_addresses)), self.router)
        self._start_loops()
        return self.address

    def _start_loops(self) -> None:
        """The supervisor and the autoscaler, as the config asks."""
        cfg = self.config
        if cfg.supervise_interval_s:
            from pdserve.cluster.supervisor import Supervisor

            self._supervisor = Supervisor(self, cfg.supervise_interval_s)
            self._supervisor.start()
        if cfg.autoscaling:
            from pdserve.cluster.autoscaler import Autoscaler

            self.autoscaler = Autoscaler(self, cfg.autoscaled_pools(), cfg.autoscale_interval_s, cfg.autoscale_history)
            self.autoscaler.start()
        if cfg.role_budget is not None:
            from pdserve.cluster.role_balancer import RoleBalancer

            self.role_balancer = RoleBalancer(self, cfg.role_budget, cfg.budget_targets(), cfg.autoscale_interval_s)
            self.role_balancer.start()

    def _actor_options(self, kind: str) -> dict:
        """Ray options that name a detached cluster's actor (``kind``: router, prefill, decode)."""
        if not self.detached:
            return {}
        return {"name": f"{kind}.{uuid.uuid4().hex[:12]}", "lifetime": "detached"}

    def adopt(self) -> bool:
        """Take over the router and workers a previous controller of this namespace left running:
        their slots, addresses and placement groups, from each actor's own ``describe``. A pool
        found short of its configured size (a worker died while no controller watched) is filled
        up. Starts the supervisor and autoscaler. False, and nothing done, if no router runs."""
        from pdserve.wire.address import split

        found = {"router": [], "prefill": [], "decode": []}
        for name in ray.util.list_named_actors():
            if name.split(".", 1)[0] not in found:
                continue
            try:
                actor = ray.get_actor(name)
                described = ray.get(actor.describe.remote(), timeout=30)
                role = described["role"]  # an elastic worker's current role
                found[POOL.get(role, role)].append((actor, described))
            except Exception as exc:  # it died while no controller watched; its slot is refilled below
                log.warning("not adopting %s: %s", name, exc)
        if not found["router"]:
            return False
        self.router, router = found["router"][-1]
        for extra, _ in found["router"][:-1]:  # a router whose replacement was started before a crash
            ray.kill(extra, no_restart=True)
        self.address, self.http_address, self.admin_address = (router["address"], router["http_address"],
                                                               router["internal_address"])
        self._router_config = dataclasses.replace(
            router["config"], grpc_port=split(self.address)[1],
            http_port=split(self.http_address)[1] if self.http_address else router["config"].http_port)
        for role in ("prefill", "decode"):
            for actor, d in sorted(found[role], key=lambda a: int(a[1]["config"].worker_id.rsplit("-", 1)[1])):
                self.slots.put(d["role"], Slot(actor, d["address"], d["group"], (d["placement"], d["config"], d["threads"])))
                self._templates.setdefault(role, (d["placement"], d["config"], d["threads"]))
                self._next_id[role] = max(self._next_id[role], int(d["config"].worker_id.rsplit("-", 1)[1]) + 1)
        remove_orphan_groups(self._group_prefix(), {pg.id.hex() for pg in self.slots.groups()})
        for role, size in (("prefill", self.config.num_prefill), ("decode", self.config.num_decode)):
            if role in self.config.pools():
                self._templates.setdefault(role, (self._pool_placement(role), self.config.worker_config(role, 0),
                                                  self.config.worker_threads()))
                while len(self.actors(role)) < size:
                    log.warning("%s pool has %d of %d workers; starting one", role, len(self.actors(role)), size)
                    self.scale_up(role)
        self.push_membership()
        self._start_loops()
        return True

    def _group_prefix(self) -> str:
        """How the names of this cluster's placement groups begin (a detached one: its namespace's)."""
        if self.detached:
            return f"pdserve:{ray.get_runtime_context().namespace}:"
        return f"pdserve-{id(self):x}-"

    def _pool_placement(self, role: str) -> PoolPlacement:
        placement = self.config.prefill_placement if role == "prefill" else self.config.decode_placement
        return dataclasses.replace(placement, ranks=self.config.tp(role))  # a bundle per tensor-parallel rank

    def _router_actor(self, router_cfg):
        """A router actor, not started yet. It runs on this (the driver's) node: its public
        address is where `pdserve serve` was started, not a node Ray happened to pick."""
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        return ServerActor.options(scheduling_strategy=here, **self._actor_options("router")).remote(
            "router", router_cfg, None, self.config.log)

    def _start_router(self, router_cfg, actor=None) -> None:
        """Start the router, in ``actor`` (``_router_actor``'s) or a new one. Its public ports are
        then pinned in its config, so that a router restarted by the supervisor
        (``restart_router``) serves where clients connect."""
        from pdserve.wire.address import split

        self.router = actor if actor is not None else self._router_actor(router_cfg)
        self.address = ray.get(self.router.start.remote(router_cfg))
        self.http_address = ray.get(self.router.http_address.remote())
        self.admin_address = ray.get(self.router.internal_address.remote())
        self._router_config = dataclasses.replace(
            router_cfg, grpc_port=split(self.address)[1],
            http_port=split(self.http_address)[1] if self.http_address else router_cfg.http_port)

    def restart_router(self) -> str:
        """Start a new router in place of a dead one, on the same public ports, and give it the
        current membership. The requests the dead one carried are lost (their clients saw the
        connection drop); clients that reconnect are served. Returns its public address."""
        with self.lock:
            try:
                ray.kill(self.router, no_restart=True)
            except Exception:  # already gone
                pass
            self._start_router(dataclasses.replace(self._router_config, prefill_addresses=tuple(self.prefill_addresses),
                                                   decode_addresses=tuple(self.decode_addresses)))
            self.push_membership()
            return self.address

    def surge_router(self):
        """Start a second router on the same public ports (both listen, with SO_REUSEPORT, and
        the kernel spreads new connections over them) and give it the membership; it becomes
        the cluster's router. Returns the one it replaces, still serving, for
        ``pdserve.cluster.rollout`` to hand over; on failure the old one stays the router."""
        with self.lock:
            old = (self.router, self.address, self.http_address, self.admin_address, self._router_config)
            try:
                self._start_router(dataclasses.replace(self._router_config, prefill_addresses=tuple(self.prefill_addresses),
                                                       decode_addresses=tuple(self.decode_addresses)))
                self.push_membership()
            except Exception:
                if self.router is not old[0]:
                    ray.kill(self.router, no_restart=True)
                self.router, self.address, self.http_address, self.admin_address, self._router_config = old
                raise
            return old[0]

    def _init_ray(self) -> None:
        """Join ``ray_address``, or start a Ray of our own with token authentication
        (``ray_token_auth``), so that nobody else can run code in it."""
        cfg = self.config
        if cfg.ray_address:
            ray.init(address=cfg.ray_address, include_dashboard=False, logging_level=logging.WARNING)
            return
        start_local_ray(local_ray_cpus(cfg), cfg.ray_token_auth)
        self._started_ray = True

    def _place(self, role: str, placement: PoolPlacement, config, threads: int) -> tuple:
        """A worker actor inside a placement group of its own: (actor, group, spec), for a slot
        (``spec``: what starts again there, with the cores it was pinned to). Unless the pool names its CPUs,
        Ray reserves as many as the worker runs torch threads. On a Ray this cluster started,
        with a core for every thread, the worker is also pinned to cores of its own; on an
        oversubscribed machine it is not (measured on 2 cores and 4 workers: pinning kept the
        OS from moving a busy worker to an idle core, and decode fell behind)."""
        self._templates.setdefault(role, (placement, config, threads))
        if placement.cpus == PoolPlacement().cpus:
            placement = dataclasses.replace(placement, cpus=float(threads))
        if self._started_ray and self.config.max_workers() * threads <= (os.cpu_count() or 1):
            slot = next(self._core_slots)
            cpus = tuple((slot * threads + k) % (os.cpu_count() or 1) for k in range(threads))
            borrow = tuple(c for c in range(os.cpu_count() or 1) if c not in cpus) if self.config.borrow_idle_cores else ()
            config = _pinned(config, cpus, borrow)
            if borrow and hasattr(config, "lend_tpot_s"):  # a decode worker (not an elastic one's half)
                config = dataclasses.replace(config, lend_tpot_s=self.config.lend_tpot_s)
        pg, options = reserve(placement, f"{self._group_prefix()}{config.worker_id}-{uuid.uuid4().hex[:8]}",
                              detached=self.detached)
        actor = ServerActor.options(**options, **self._actor_options(role)).remote(
            role, config, threads, self.config.log, placement)
        return actor, pg, (placement, config, threads)

    def actors(self, role: str) -> list:
        return self.prefill if role == "prefill" else self.decode

    def addresses(self, role: str) -> list[str]:
        return self.prefill_addresses if role == "prefill" else self.decode_addresses

    def replace(self, role: str, index: int) -> str:
        """Start a new worker in a slot whose worker died; returns its address."""
        remove(self.slots.group(role, index))
        actor, group, spec = self._place(role, *self.slots.spec(role, index))
        self.slots.refill(role, index, actor, group, spec, ray.get(actor.start.remote()))
        return self.addresses(role)[index]

    def change_template(self, role: str, change) -> None:
        """Start ``role``'s next workers from ``change(config)`` of today's (a rollout to a new
        setting: ``pdserve.cluster.rollout.roll_verify``)."""
        with self.lock:
            if role in self._templates:  # else the cluster has no such pool
                placement, config, threads = self._templates[role]
                self._templates[role] = (placement, change(config), threads)

    def scale_up(self, role: str) -> str:
        """Start one more worker in ``role``'s pool; it joins the router once it serves."""
        with self.lock:
            placement, config, threads = self._templates[role]
            worker_id = f"{role}-{self._next_id[role]}"
            self._next_id[role] += 1
            actor, group, spec = self._place(role, placement, dataclasses.replace(config, worker_id=worker_id), threads)
            index = self.slots.add(role, actor, group, spec, ray.get(actor.start.remote()))
            self.push_membership()
            return self.addresses(role)[index]

    def scale_down(self, role: str, index: int = -1, drain_timeout_s: float = 300.0,
                   hand_over_after_s: float = HAND_OVER_AFTER_S) -> str:
        """Remove one worker by draining it: it leaves the routing table first, takes no new
        request, finishes the ones it has (a prefill worker also waits until its held KV is
        pulled or expires), and only then stops. Returns its address."""
        with self.lock:
            address = self.addresses(role)[index % len(self.actors(role))]
        self.retire(role, address, drain_timeout_s, hand_over_after_s)
        return address

    def retire(self, role: str, address: str, drain_timeout_s: float,
               hand_over_after_s: float = HAND_OVER_AFTER_S) -> bool | None:
        """Drain the worker at ``address`` out of the cluster (see ``scale_down``). True if it
        went idle within ``drain_timeout_s`` (else it is stopped busy, and the router migrates
        what it ran); None if no slot serves there (it was replaced or removed meanwhile). An
        elastic decode worker's streams still running after ``hand_over_after_s`` move with
        their KV first, if a decode worker is left (``pdserve.cluster.roles.hand_over_to_retire``)."""
        start = time.monotonic()
        with self.lock:
            if address not in self.addresses(role):
                return None
            slot = self.slots.drop(POOL[role], self.addresses(role).index(address))
            self.push_membership()
        if self.config.elastic_roles and role == "decode" and self.addresses("decode"):  # somewhere to move to
            role = hand_over_to_retire(self, address, min(hand_over_after_s, drain_timeout_s / 2))
        idle = drain_worker(role, address, self.config.tls_for("controller"),
                            max(0.0, drain_timeout_s - (time.monotonic() - start)))
        try:  # a drain out of time has spent the grace: what still runs is cut now, not 2 s later
            ray.get(slot.actor.stop.remote(grace_s=2.0 if idle else 0.0), timeout=30)
        finally:
            ray.kill(slot.actor)
            remove(slot.group)  # only now: removing a placement group kills the actors in it
        return idle

    def set_role(self, address: str, role: str, grace_s: float = DRAIN_GRACE_SECONDS.default,
                 reason: str = "manual"):
        """Switch the elastic worker at ``address`` to ``role`` in place (``pdserve.cluster.roles``)."""
        return switch_role(self, address, role, grace_s, reason)

    def role_of(self, address: str) -> str:
        """The role of the worker at ``address``: its pool, or ``mixed`` (an elastic worker in the
        decode pool's slots that also prefills its own requests); ValueError if none serves there."""
        return self.slots.role_of(address)

    def push_membership(self, exclude: set[str] = frozenset(), role_changes: tuple = ()) -> None:
        """Tell the router the workers it may route to: all live slots, minus ``exclude``;
        ``role_changes`` (``admin_pb2.RoleChange``): switches this push completes."""
        from pdserve.protos import admin_pb2, admin_pb2_grpc

        members = [admin_pb2.Member(role=role, address=address) for role, address in self.slots.members(exclude)]
        desired = self.autoscaler.desired() if self.autoscaler is not None else {}
        targets = {pool: policy.target for pool, policy in self.config.autoscaled_pools().items()}
        pressure = self.role_balancer.pressures() if self.role_balancer is not None else {}
        with channel(self.admin_address, self.config.tls_for("controller"), peer="router") as ch:
            admin_pb2_grpc.RouterAdminStub(ch).SetMembership(
                admin_pb2.Membership(members=members, desired_replicas=desired, signal_targets=targets,
                                     role_changes=role_changes, budget_pressure=pressure), timeout=PUSH_TIMEOUT_S)

    def drain(self, grace_s: float) -> int:
        """The router stops admitting (health NOT_SERVING, new requests UNAVAILABLE / 503) and
        waits up to ``grace_s`` for its requests to finish; the workers serve them meanwhile.
        Returns how many were still running. ``stop()`` comes after."""
        if self.router is None:
            return 0
        return ray.get(self.router.drain.remote(grace_s), timeout=grace_s + 2)  # it answers by grace_s

    def stop_supervising(self) -> None:
        """Replace and scale nothing from now on; at once, without waiting for a round in
        progress (see ``pdserve.cluster.shutdown``: a stopping cluster's workers exit on purpose)."""
        for loop in (self._supervisor, self.autoscaler, self.role_balancer):
            if loop is not None:
                loop.halt()

    def ray_lost(self) -> bool:
        """Whether the Ray this cluster started has lost its GCS or raylet (a signal to the
        process group reaches them too): then every Ray call would wait on them in vain."""
        node = getattr(ray._private.worker, "_global_node", None)
        if not self._started_ray or node is None:
            return False
        return any(info.process.poll() is not None
                   for kind in ("gcs_server", "raylet") for info in node.all_processes.get(kind, []))

    def stop(self, stop_timeout_s: float = 5.0) -> None:
        """Stop every actor (all at once, each given ``stop_timeout_s``), remove the placement
        groups, and end the Ray this cluster started. Never raises: a Ray already gone (the
        process group's SIGTERM reached it too) has nothing left to stop."""
        for loop in (self.role_balancer, self.autoscaler, self._supervisor):
            if loop is not None:
                loop.stop(join_s=stop_timeout_s)
        actors = [a for a in [self.router, *self.decode, *self.prefill] if a is not None]
        steps = [lambda: ray.wait([a.stop.remote() for a in actors], num_returns=len(actors), timeout=stop_timeout_s)]
        steps += [lambda a=a: ray.kill(a) for a in actors] + [lambda g=g: remove(g) for g in self.slots.groups()]
        for step in steps:
            try:
                step()
            except Exception as exc:  # a dead actor, or a Ray already gone
                log.warning("stopping the cluster: %s", exc)
        if self._started_ray:
            ray.shutdown()


def _pinned(config, cpus: tuple[int, ...], borrow: tuple[int, ...]):
    """A worker's config pinned to ``cpus``, its kernels free to borrow ``borrow`` while idle. An
    elastic worker's two cores both carry it (its decode core's settings pin the process, whatever
    its role). A config without cores (the router's) is returned as it is."""
    if hasattr(config, "decode") and hasattr(config, "prefill"):
        return dataclasses.replace(config, decode=_pinned(config.decode, cpus, borrow),
                                   prefill=_pinned(config.prefill, cpus, borrow))
    if hasattr(config, "cpus"):
        return dataclasses.replace(config, cpus=cpus, borrow_cpus=borrow)
    return config
