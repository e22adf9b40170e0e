"""``pdserve worker --role router``: the router as a plain process whose workers join it
(``pdserve.cluster.worker_cli``), for Kubernetes without Ray.

Nobody else owns the table here, so the router keeps it true itself: a member that has not
answered a stats poll for ``member_timeout_seconds`` is dropped (a pod killed without its
drain; a restarted pod joins again under its new address). The optional controller only
watches (``Autoscaler(observe_only=True)``): KEDA or an HPA changes the worker counts.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from pdserve.cluster.plain_process import engine_config, internal_tls, stop_signal
from pdserve.cluster.typed_settings import DEFAULT_TTFT_OBJECTIVE_S, WorkerSettings
from pdserve.elastic_worker.roles import POOL
from pdserve.router.pool import WorkerPool
from pdserve.wire.tls import TlsConfig

log = logging.getLogger(__name__)


def router_config(s: WorkerSettings):
    """The router's frozen config from the settings (no layout here: the prefill overflow's
    default is half ``DEFAULT_TTFT_OBJECTIVE_S``, as ``pdserve serve``'s default layout has it)."""
    from pdserve.cluster.serve_config import router_limits
    from pdserve.router.auth import read_keys
    from pdserve.router.server import RouterConfig
    from pdserve.wire import tls

    api, internal = s.api, s.internal
    api_key, api_keys = read_keys(api.api_key, api.api_key_file, api.api_keys_file)
    return RouterConfig(engine=engine_config(s), host=api.host, grpc_port=api.grpc_port,
                        http_port=None if api.port < 0 else api.port, advertise_host=api.advertise_host,
                        api_key=api_key, api_keys=api_keys, allow_runtime_lora_updating=api.allow_runtime_lora_updating,
                        public_tls=tls.load(api.public_tls_cert, api.public_tls_key, api.public_tls_ca,
                                            prefix="public_tls", require_ca=False),
                        internal_host=internal.internal_host, internal_port=s.plain.internal_port,
                        internal_advertise_host=internal.internal_advertise_host, tls=internal_tls(internal, s.role),
                        insecure_internal=internal.insecure_internal,
                        limits=router_limits(s.router, DEFAULT_TTFT_OBJECTIVE_S),
                        connection_age_s=s.plain.max_connection_age_seconds or None,
                        otlp_traces_endpoint=s.process.otlp_traces_endpoint)


async def run_router(s: WorkerSettings, config, autoscaling: dict | None) -> None:
    """Serve until SIGTERM, then hand over (``pdserve.router.handover``: readiness false, stop
    listening and send clients GOAWAY, running streams finish within the grace) and stop. A
    rolling update's new router is behind the same Service by then; the pod's preStop sleep
    has let the endpoints drop this one first, so nothing new is refused here.
    ``autoscaling``: the pools' policies for the observe-only controller; None: no controller."""
    from pdserve.router.handover import hand_over
    from pdserve.router.server import start

    running = await start(config)
    pool = running.service.pool
    pruner = asyncio.create_task(prune_silent(pool, s.plain.member_timeout_seconds, s.plain.join_interval_seconds))
    observer = _observe(running.internal_address, config.tls, pool, autoscaling)
    http = f", OpenAI HTTP API on http://{running.http_address}/v1" if running.http_address else ""
    print(f"router: gRPC API listening on {running.address}{http}; workers join at {running.internal_address}",
          flush=True)
    await stop_signal()
    grace = s.process.drain_grace_seconds
    print(f"router: draining (up to {grace:g} s)", flush=True)
    left = await hand_over(running, 0.0, grace, config.connection_age_s)
    if left:
        print(f"router: {left} request(s) still running after the grace period; stopping anyway", flush=True)
    pruner.cancel()
    if observer is not None:
        await asyncio.to_thread(observer.stop)
    await running.stop()


def autoscaling(s: WorkerSettings):
    from pdserve.cluster.autoscaling import from_mapping

    return from_mapping(s.autoscaling) if s.autoscaling is not None else None


async def prune_silent(pool: WorkerPool, timeout_s: float, interval_s: float) -> None:
    """Drop members that have been unreachable for ``timeout_s``."""
    loop = asyncio.get_running_loop()
    silent_since: dict[str, float] = {}
    while True:
        await asyncio.sleep(interval_s)
        now = loop.time()
        for address, worker in list(pool.workers.items()):
            if worker.healthy:
                silent_since.pop(address, None)
            elif now - silent_since.setdefault(address, now) >= timeout_s:
                log.warning("dropping %s worker %s: unreachable for %.0f s", worker.role, address, timeout_s)
                silent_since.pop(address)
                await pool.remove(address)


@dataclass(frozen=True)
class _ObservedConfig:
    """What the autoscaler reads of a cluster's config."""

    tls: TlsConfig | None  # the router's own: the internal plane admits the router to Stats and GetLatency

    def tls_for(self, role: str) -> TlsConfig | None:
        """``ClusterConfig.tls_for``'s answer here: one process, one certificate for every role."""
        return self.tls


class ObservedCluster:
    """What ``Autoscaler`` needs of a cluster, for a router whose workers are not ours to start:
    the members come from ``RouterAdmin.GetMembership`` (the autoscaler samples from its own
    thread, and the table lives on the router's event loop), and each decision reaches the
    router's ``pdserve:autoscaler_desired_replicas`` gauge through that loop."""

    def __init__(self, admin_address: str, tls: TlsConfig | None, pool: WorkerPool,
                 loop: asyncio.AbstractEventLoop):
        self.admin_address = admin_address
        self.config = _ObservedConfig(tls)
        self.autoscaler = None
        self._pool, self._loop = pool, loop

    def addresses(self, role: str) -> list[str]:
        from pdserve.protos import admin_pb2, admin_pb2_grpc
        from pdserve.wire.grpc_util import channel

        with channel(self.admin_address, self.config.tls, peer="router") as ch:
            table = admin_pb2_grpc.RouterAdminStub(ch).GetMembership(admin_pb2.Membership(), timeout=2)
        return [m.address for m in table.members if POOL.get(m.role, m.role) == role]  # a mixed worker: decode

    def push_membership(self) -> None:
        if self.autoscaler is not None:
            self._loop.call_soon_threadsafe(self._pool.desired_replicas.update, self.autoscaler.desired())


def _observe(admin_address: str, tls: TlsConfig | None, pool: WorkerPool, configs):
    """Start the observe-only controller when the config has an ``autoscaling:`` section."""
    if configs is None:
        return None
    from pdserve.cluster.autoscaler import Autoscaler

    cluster = ObservedCluster(admin_address, tls, pool, asyncio.get_running_loop())
    cluster.autoscaler = Autoscaler(cluster, configs, observe_only=True)
    cluster.autoscaler.start()
    return cluster.autoscaler
