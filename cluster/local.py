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
from dataclasses import dataclass, field

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cluster.mode import COLOCATED, DISAGGREGATED, MODES
from cluster.actors import ServerActor
from cluster.placement import PoolPlacement, release, reserve
from cluster.ray_start import start_local_ray
from engine.config import EngineConfig
from kv_transfer import DEFAULT_BACKEND
from kv_transfer.handoff import DEFAULT_LEASE_SECONDS
from router.limits import RouterLimits
from router.tool_parsers import DEFAULT_PARSER
from wire.grpc_util import channel
from wire.logs import LogConfig
from wire.tls import TlsConfig

log = logging.getLogger(__name__)

SECRET_SET = "<set>"  # ``ClusterConfig.without_secrets``: a secret is configured, its value withheld


@dataclass(frozen=True)
class ClusterConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    # disaggregated: a prefill pool and a decode pool, KV moved between them. colocated: no
    # prefill pool; the decode pool's workers prefill their own requests, prompt chunks mixed
    # into their decode steps (the baseline the disaggregated mode is measured against).
    mode: str = DISAGGREGATED
    num_prefill: int = 1  # 0 in colocated mode
    num_decode: int = 1
    host: str = "127.0.0.1"  # the public plane's bind address (router gRPC and HTTP), as `vllm serve --host`
    grpc_port: int = 50051  # the router's public gRPC port (`pdserve serve --grpc-port`)
    http_port: int | None = 8000  # the router's OpenAI-compatible HTTP port (`--port`); None: off
    advertise_host: str | None = None  # the public address to report; None: from host (wire.address)
    # The internal plane (RouterAdmin, every worker RPC, worker /metrics, the tcp block server)
    # binds this on every node. None: 127.0.0.1 when pdserve starts Ray itself (one machine:
    # nothing internal is reachable from the network), each node's Ray IP when it joins one.
    internal_host: str | None = None
    internal_advertise_host: str | None = None  # only for one node (NAT); None: the bound address
    api_key: str | None = field(default=None, repr=False)  # clients must send it (router.auth); None: open. Never printed
    tls: TlsConfig | None = None  # mTLS on the internal plane (wire.tls); None: plaintext
    # Each role's own identity on the internal plane (role -> its certificate, from
    # ``cluster.certs``), so that each internal RPC accepts only the roles that need it
    # (wire.internal_plane); a role not named here uses ``tls``.
    role_tls: tuple[tuple[str, TlsConfig], ...] = ()
    insecure_internal: bool = False  # the internal plane may listen beyond loopback without mTLS
    public_tls: TlsConfig | None = None  # TLS on the public plane
    ray_token_auth: bool = True  # a Ray pdserve starts runs with token authentication
    kv_transfer_backend: str = DEFAULT_BACKEND
    lease_seconds: float = DEFAULT_LEASE_SECONDS
    worker_max_requests: int = 1024  # requests one worker holds at once; past it RESOURCE_EXHAUSTED
    max_receive_bytes: int = 4 << 20  # largest gRPC request each server accepts (the router's public one: see RouterConfig)
    router_limits: RouterLimits = field(default_factory=RouterLimits)  # admission wait, timeouts, sizes
    transfer_timeout_s: float = 10.0
    inject_transfer_delay_s: float = 0.0  # test hook: slow every KV read by this much
    threads_per_worker: int | None = None  # torch threads per worker; None: cores / workers
    borrow_idle_cores: bool = False  # pinned workers also borrow the other workers' cores while idle (opt-in)
    step_trace_dir: str | None = None  # each worker's engine steps, one JSON line each (engine.step_trace)
    ray_address: str | None = None  # join this Ray cluster instead of starting one
    served_model_names: tuple[str, ...] = ("smollm2",)  # what the API answers to; the first is reported
    tokenizer: str | None = None  # the router's tokenizer directory; None: the model's
    chat_template: str | None = None  # a Jinja chat template; None: the tokenizer's
    tool_call_parser: str = DEFAULT_PARSER  # router.tool_parsers: reads tool_choice "auto" answers
    log: LogConfig = field(default_factory=LogConfig)  # every process's level and format
    router_poll_s: float = 0.2  # how often the router reads every worker's stats
    supervise_interval_s: float | None = 1.0  # how often dead workers are found and replaced; None: never
    # A worker whose engine makes no progress this long while it holds work, or that does not
    # answer this long, is hung: the router migrates its requests, the supervisor replaces it.
    hang_timeout_s: float = 30.0
    autoscaling: dict | None = None  # {"prefill": PoolPolicyConfig, "decode": ...}; None: fixed pool sizes
    autoscale_interval_s: float = 1.0
    autoscale_history: int = 3600  # samples and decisions the autoscaler keeps per pool (the last hour at 1 s)
    prefill_placement: PoolPlacement = field(default_factory=lambda: PoolPlacement(gpus=default_gpus()))
    decode_placement: PoolPlacement = field(default_factory=lambda: PoolPlacement(gpus=default_gpus()))

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.mode == COLOCATED and self.num_prefill:
            raise ValueError(f"num_prefill must be 0 in colocated mode (no prefill pool), got {self.num_prefill}")
        # A claim renews the lease for lease_seconds and the read may take transfer_timeout_s:
        # a lease no longer than that could free (and hand out) blocks a reader still reads.
        if self.lease_seconds <= self.transfer_timeout_s:
            raise ValueError(f"lease_seconds ({self.lease_seconds:g} s, --lease-seconds) must exceed "
                             f"transfer_timeout_s ({self.transfer_timeout_s:g} s, the KV read timeout), or a "
                             f"lease could expire while a decode worker reads its blocks")

    def without_secrets(self) -> "ClusterConfig":
        """This config for whoever may read it (``Controller.config``, any Ray client): the API
        key replaced by a marker that it is set, and no TLS private keys."""
        return dataclasses.replace(
            self, api_key=SECRET_SET if self.api_key is not None else None,
            tls=dataclasses.replace(self.tls, key_pem=b"") if self.tls is not None else None,
            public_tls=dataclasses.replace(self.public_tls, key_pem=b"") if self.public_tls is not None else None)

    def pools(self) -> tuple[str, ...]:
        """The pools this cluster runs (colocated: the decode pool only)."""
        return ("decode",) if self.mode == COLOCATED else ("prefill", "decode")

    def autoscaled_pools(self) -> dict:
        """The autoscaling policies of the pools this cluster runs (none without autoscaling)."""
        return {pool: policy for pool, policy in (self.autoscaling or {}).items() if pool in self.pools()}

    def router_limits_for_mode(self) -> RouterLimits:
        """The router's limits, told whether every request prefills on its decode worker."""
        if self.mode != COLOCATED:
            return self.router_limits
        local = dataclasses.replace(self.router_limits.local_prefill, colocated=True)
        return dataclasses.replace(self.router_limits, local_prefill=local)

    def internal_bind_host(self) -> str | None:
        """``internal_host`` as servers take it (None: each resolves its node's IP)."""
        if self.internal_host is None and self.ray_address is None:
            return "127.0.0.1"
        return self.internal_host

    def tls_for(self, role: str) -> TlsConfig | None:
        """The internal plane's TLS of ``role`` (router, prefill, decode, controller)."""
        return dict(self.role_tls).get(role, self.tls)

    def worker_threads(self) -> int:
        if self.threads_per_worker:
            return self.threads_per_worker
        return max(1, (os.cpu_count() or 1) // (self.num_prefill + self.num_decode))


def _max_workers(cfg: ClusterConfig) -> int:
    """Workers the cluster may run at once (autoscaling included)."""
    workers = 0
    for pool, count in (("prefill", cfg.num_prefill), ("decode", cfg.num_decode)):
        if pool not in cfg.pools():
            continue
        policy = (cfg.autoscaling or {}).get(pool)
        workers += max(count, getattr(policy, "max_replicas", count))
    return workers


# A Ray that pdserve starts on one machine is that machine: its workers share the cores on
# purpose (more threads than cores on a small box), the OS schedules them, and pinning is a
# separate choice. There the CPU resource is bookkeeping and must never be what stops a
# placement, also for further clusters a driver starts in the same Ray (the tests run several
# in one process). On a real multi-node Ray (``ray_address``) the nodes' own counts apply.
LOCAL_RAY_MIN_CPUS = 64


def _local_ray_cpus(cfg: ClusterConfig) -> int:
    """CPUs a Ray this cluster starts announces: room for every worker it may run (each reserves
    its torch threads), never fewer than ``LOCAL_RAY_MIN_CPUS`` or the machine's cores."""
    return max(os.cpu_count() or 1, LOCAL_RAY_MIN_CPUS, _max_workers(cfg) * cfg.worker_threads() + 1)


def default_gpus() -> float:
    import torch

    return 1.0 if torch.cuda.is_available() else 0.0


class LocalCluster:
    """The controller's state and actions: it starts the router and the workers, replaces dead
    ones (``cluster.supervisor``), scales pools (``cluster.autoscaler``) and stops them all.

    ``detached``: every actor and placement group it makes outlives the process that runs it, and
    is named in the Ray namespace, so that a controller started again (``cluster.controller``)
    finds them and takes them over (``adopt``) instead of starting the workers again."""

    def __init__(self, config: ClusterConfig, detached: bool = False):
        self.config = config
        self.detached = detached
        self.prefill: list = []
        self.decode: list = []
        self.router = None
        self.prefill_addresses: list[str] = []
        self.decode_addresses: list[str] = []
        self.address: str | None = None  # the router's public gRPC address
        self.http_address: str | None = None
        self.admin_address: str | None = None  # the router's internal plane (RouterAdmin)
        self._groups: dict[tuple[str, int], object] = {}  # one placement group per worker slot
        self._specs: dict[tuple[str, int], tuple] = {}  # what to start again in a slot
        self._supervisor = None  # a cluster.supervisor.Supervisor
        self._router_config = None  # what restart_router starts again
        self.autoscaler = None
        self._templates: dict[str, tuple] = {}  # role -> (placement, config, threads) for new slots
        self._next_id = {"prefill": 0, "decode": 0}
        self.lock = threading.RLock()  # membership changes: scaling and the supervisor
        self._started_ray = False
        self._core_slots = itertools.count()  # which cores the next pinned worker gets

    def start(self) -> str:
        from engine.loader import materialize
        from router.server import RouterConfig

        cfg = self.config
        materialize(cfg.engine.model, progress=True)  # convert a GGUF once, before the workers race to
        if not ray.is_initialized():
            self._init_ray()
        threads = cfg.worker_threads()
        self.prefill = [self._place("prefill", i, cfg.prefill_placement, self._worker_config("prefill", i), threads)
                        for i in range(cfg.num_prefill)]
        self.decode = [self._place("decode", i, cfg.decode_placement, self._worker_config("decode", i), threads)
                       for i in range(cfg.num_decode)]
        self.prefill_addresses = ray.get([a.start.remote() for a in self.prefill])
        self.decode_addresses = ray.get([a.start.remote() for a in self.decode])
        router_cfg = RouterConfig(engine=cfg.engine, served_model_names=cfg.served_model_names,
                                  tokenizer=cfg.tokenizer, chat_template=cfg.chat_template,
                                  tool_call_parser=cfg.tool_call_parser, host=cfg.host,
                                  grpc_port=cfg.grpc_port, http_port=cfg.http_port, advertise_host=cfg.advertise_host, api_key=cfg.api_key,
                                  public_tls=cfg.public_tls, internal_host=cfg.internal_bind_host(),
                                  internal_advertise_host=cfg.internal_advertise_host, tls=cfg.tls_for("router"),
                                  insecure_internal=cfg.insecure_internal,
                                  stats_interval_s=cfg.router_poll_s, hang_timeout_s=cfg.hang_timeout_s,
                                  max_receive_bytes=cfg.max_receive_bytes,
                                  limits=cfg.router_limits_for_mode(),
                                  prefill_addresses=tuple(self.prefill_addresses),
                                  decode_addresses=tuple(self.decode_addresses))
        self._start_router(router_cfg)
        self._start_loops()
        return self.address

    def _worker_config(self, role: str, index: int):
        """The config of ``role``'s worker number ``index``."""
        from decode_worker.worker import DecodeWorkerConfig
        from prefill_worker.worker import PrefillWorkerConfig

        cfg = self.config
        common = dict(worker_id=f"{role}-{index}", model_name=cfg.served_model_names[0], engine=cfg.engine,
                      host=cfg.internal_bind_host(), tls=cfg.tls_for(role), advertise_host=cfg.internal_advertise_host,
                      insecure_internal=cfg.insecure_internal,
                      kv_transfer_backend=cfg.kv_transfer_backend, max_requests=cfg.worker_max_requests,
                      max_receive_bytes=cfg.max_receive_bytes, step_trace_dir=cfg.step_trace_dir)
        if role == "prefill":
            return PrefillWorkerConfig(lease_seconds=cfg.lease_seconds, **common)
        return DecodeWorkerConfig(transfer_timeout_s=cfg.transfer_timeout_s,
                                  inject_transfer_delay_s=cfg.inject_transfer_delay_s, **common)

    def _start_loops(self) -> None:
        """The supervisor and the autoscaler, as the config asks."""
        cfg = self.config
        if cfg.supervise_interval_s:
            from cluster.supervisor import Supervisor

            self._supervisor = Supervisor(self, cfg.supervise_interval_s)
            self._supervisor.start()
        if cfg.autoscaling:
            from cluster.autoscaler import Autoscaler

            self.autoscaler = Autoscaler(self, cfg.autoscaled_pools(), cfg.autoscale_interval_s, cfg.autoscale_history)
            self.autoscaler.start()

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
        from wire.address import split

        found = {"router": [], "prefill": [], "decode": []}
        for name in ray.util.list_named_actors():
            kind = name.split(".", 1)[0]
            if kind not in found:
                continue
            try:
                actor = ray.get_actor(name)
                found[kind].append((actor, ray.get(actor.describe.remote(), timeout=30)))
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
                index = len(self.actors(role))
                self.actors(role).append(actor)
                self.addresses(role).append(d["address"])
                self._specs[(role, index)] = (d["placement"], d["config"], d["threads"])
                self._groups[(role, index)] = d["group"]
                self._templates.setdefault(role, (d["placement"], d["config"], d["threads"]))
                self._next_id[role] = max(self._next_id[role], int(d["config"].worker_id.rsplit("-", 1)[1]) + 1)
        self._release_orphan_groups()
        for role, size in (("prefill", self.config.num_prefill), ("decode", self.config.num_decode)):
            if role in self.config.pools():
                self._templates.setdefault(role, (self._pool_placement(role), self._worker_config(role, 0),
                                                  self.config.worker_threads()))
                while len(self.actors(role)) < size:
                    log.warning("%s pool has %d of %d workers; starting one", role, len(self.actors(role)), size)
                    self.scale_up(role)
        self.push_membership()
        self._start_loops()
        return True

    def _release_orphan_groups(self) -> None:
        """Remove the detached placement groups of this namespace that no adopted worker runs in
        (their worker died while no controller watched)."""
        from ray.util.placement_group import PlacementGroup, placement_group_table

        prefix = self._group_prefix()
        kept = {pg.id.hex() for pg in self._groups.values()}
        for pg_id, info in placement_group_table().items():
            if info.get("name", "").startswith(prefix) and info.get("state") != "REMOVED" and pg_id not in kept:
                release(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))

    def _group_prefix(self) -> str:
        """How the names of this cluster's placement groups begin (a detached one: its namespace's)."""
        if self.detached:
            return f"pdserve:{ray.get_runtime_context().namespace}:"
        return f"pdserve-{id(self):x}-"

    def _pool_placement(self, role: str) -> PoolPlacement:
        return self.config.prefill_placement if role == "prefill" else self.config.decode_placement

    def _start_router(self, router_cfg) -> None:
        """Start the router actor. Its public ports are then pinned in its config, so that a
        router restarted by the supervisor (``restart_router``) serves where clients connect."""
        from wire.address import split

        # The router runs on this (the driver's) node: its public address is where `pdserve
        # serve` was started, not a node Ray happened to pick.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.router = ServerActor.options(scheduling_strategy=here, **self._actor_options("router")).remote(
            "router", router_cfg, None, self.config.log)
        self.address = ray.get(self.router.start.remote())
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

    def _init_ray(self) -> None:
        """Join ``ray_address``, or start a Ray of our own with token authentication
        (``ray_token_auth``), so that nobody else can run code in it."""
        cfg = self.config
        if cfg.ray_address:
            ray.init(address=cfg.ray_address, include_dashboard=False, logging_level=logging.WARNING)
            return
        start_local_ray(_local_ray_cpus(cfg), cfg.ray_token_auth)
        self._started_ray = True

    def _place(self, role: str, index: int, placement: PoolPlacement, config, threads: int):
        """A worker actor inside a placement group of its own. Unless the pool names its CPUs,
        Ray reserves as many as the worker runs torch threads. On a Ray this cluster started,
        with a core for every thread, the worker is also pinned to cores of its own; on an
        oversubscribed machine it is not (measured on 2 cores and 4 workers: pinning kept the
        OS from moving a busy worker to an idle core, and decode fell behind)."""
        self._templates.setdefault(role, (placement, config, threads))
        if placement.cpus == PoolPlacement().cpus:
            placement = dataclasses.replace(placement, cpus=float(threads))
        if self._started_ray and hasattr(config, "cpus") and _max_workers(self.config) * threads <= (os.cpu_count() or 1):
            slot = next(self._core_slots)
            cpus = tuple((slot * threads + k) % (os.cpu_count() or 1) for k in range(threads))
            borrow = tuple(c for c in range(os.cpu_count() or 1) if c not in cpus) if self.config.borrow_idle_cores else ()
            config = dataclasses.replace(config, cpus=cpus, borrow_cpus=borrow)
        self._next_id[role] = max(self._next_id[role], index + 1)
        self._specs[(role, index)] = (placement, config, threads)
        pg, options = reserve(placement, f"{self._group_prefix()}{role}-{index}-{uuid.uuid4().hex[:8]}",
                              detached=self.detached)
        self._groups[(role, index)] = pg
        return ServerActor.options(**options, **self._actor_options(role)).remote(
            role, config, threads, self.config.log, placement)

    def actors(self, role: str) -> list:
        return self.prefill if role == "prefill" else self.decode

    def addresses(self, role: str) -> list[str]:
        return self.prefill_addresses if role == "prefill" else self.decode_addresses

    def replace(self, role: str, index: int) -> str:
        """Start a new worker in a slot whose worker died; returns its address."""
        old = self._groups.pop((role, index), None)
        if old is not None:
            release(old)
        actor = self._place(role, index, *self._specs[(role, index)])
        self.actors(role)[index] = actor
        self.addresses(role)[index] = ray.get(actor.start.remote())
        return self.addresses(role)[index]

    def scale_up(self, role: str) -> str:
        """Start one more worker in ``role``'s pool; it joins the router once it serves."""
        with self.lock:
            placement, config, threads = self._templates[role]
            worker_id = f"{role}-{self._next_id[role]}"
            index = len(self.actors(role))
            actor = self._place(role, index, placement, dataclasses.replace(config, worker_id=worker_id), threads)
            self.actors(role).append(actor)
            self.addresses(role).append(ray.get(actor.start.remote()))
            self.push_membership()
            return self.addresses(role)[index]

    def scale_down(self, role: str, index: int = -1, drain_timeout_s: float = 300.0) -> str:
        """Remove one worker by draining it: it leaves the routing table first, takes no new
        request, finishes the ones it has (a prefill worker also waits until its held KV is
        pulled or expires), and only then stops. Returns its address."""
        with self.lock:
            index %= len(self.actors(role))
            actor, address = self.actors(role)[index], self.addresses(role)[index]
            group = self._drop_slot(role, index)
            self.push_membership()
        self._drain(role, address, drain_timeout_s)
        try:
            ray.get(actor.stop.remote(), timeout=30)
        finally:
            ray.kill(actor)
            release(group)  # only now: removing a placement group kills the actors in it
        return address

    def _drop_slot(self, role: str, index: int):
        """Forget a slot (later slots move down one index); returns its placement group."""
        actors = self.actors(role)
        last = len(actors) - 1
        group = self._groups.pop((role, index))
        for i in range(index, last):  # later slots move down one index
            self._groups[(role, i)] = self._groups.pop((role, i + 1))
            self._specs[(role, i)] = self._specs.pop((role, i + 1))
        self._specs.pop((role, last), None)
        actors.pop(index)
        self.addresses(role).pop(index)
        return group

    def _drain(self, role: str, address: str, timeout_s: float) -> None:
        from protos import worker_pb2, worker_pb2_grpc

        stub_cls = worker_pb2_grpc.PrefillWorkerStub if role == "prefill" else worker_pb2_grpc.DecodeWorkerStub
        deadline = time.monotonic() + timeout_s
        with channel(address, self.config.tls_for("controller")) as ch:
            stub = stub_cls(ch)
            stats = stub.Drain(worker_pb2.DrainRequest(), timeout=10)
            while stats.num_running or stats.num_waiting or stats.num_held_leases:
                if time.monotonic() > deadline:
                    log.warning("%s still busy after %.0f s of draining; stopping it anyway", address, timeout_s)
                    return
                time.sleep(0.2)
                stats = stub.Stats(worker_pb2.StatsRequest(), timeout=10)

    def push_membership(self, exclude: set[str] = frozenset()) -> None:
        """Tell the router the workers it may route to: all live slots, minus ``exclude``."""
        from protos import admin_pb2, admin_pb2_grpc

        members = [admin_pb2.Member(role=role, address=address)
                   for role in ("prefill", "decode") for address in self.addresses(role) if address not in exclude]
        desired = self.autoscaler.desired() if self.autoscaler is not None else {}
        targets = {pool: policy.target for pool, policy in self.config.autoscaled_pools().items()}
        with channel(self.admin_address, self.config.tls_for("controller")) as ch:
            admin_pb2_grpc.RouterAdminStub(ch).SetMembership(
                admin_pb2.Membership(members=members, desired_replicas=desired, signal_targets=targets), timeout=10)

    def drain(self, grace_s: float) -> int:
        """The router stops admitting (health NOT_SERVING, new requests UNAVAILABLE / 503) and
        waits up to ``grace_s`` for its requests to finish; the workers serve them meanwhile.
        Returns how many were still running. ``stop()`` comes after."""
        if self.router is None:
            return 0
        return ray.get(self.router.drain.remote(grace_s), timeout=grace_s + 2)  # it answers by grace_s

    def stop_supervising(self) -> None:
        """Replace and scale nothing from now on; at once, without waiting for a round in
        progress (see ``cluster.shutdown``: a stopping cluster's workers exit on purpose)."""
        for loop in (self._supervisor, self.autoscaler):
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
        """Stop every actor (all at once, each given ``stop_timeout_s``), release the placement
        groups, and end the Ray this cluster started. Never raises: a Ray already gone (the
        process group's SIGTERM reached it too) has nothing left to stop."""
        if self.autoscaler is not None:
            self.autoscaler.stop(join_s=stop_timeout_s)
        if self._supervisor is not None:
            self._supervisor.stop(join_s=stop_timeout_s)
        actors = [a for a in [self.router, *self.decode, *self.prefill] if a is not None]
        steps = [lambda: ray.wait([a.stop.remote() for a in actors], num_returns=len(actors), timeout=stop_timeout_s)]
        steps += [lambda a=a: ray.kill(a) for a in actors] + [lambda g=g: release(g) for g in self._groups.values()]
        for step in steps:
            try:
                step()
            except Exception as exc:  # a dead actor, or a Ray already gone
                log.warning("stopping the cluster: %s", exc)
        if self._started_ray:
            ray.shutdown()
