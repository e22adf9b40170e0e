"""``pdserve worker --role prefill|decode|router``: one role as a plain process, without Ray,
as a Kubernetes Deployment runs it (deploy/k8s/overlays/plain-k8s).

A worker serves its role on the internal plane, then **joins** the router through
``RouterAdmin.Join`` on the router's internal address (``--router-admin``), under the role its
certificate names and at its advertised address, whose host its certificate must name too (an
IP or DNS SAN; ``python -m pdserve.cluster.certs --worker``; checked at start). It joins again every ``--join-interval-seconds`` (a no-op while it is
listed; a router restarted with an empty table lists it again). On SIGTERM it **leaves** the
table first (the router stops sending it work), then drains: health turns NOT_SERVING,
in-flight requests get up to ``--drain-grace-seconds``, then it exits 0.

The router role serves the public and internal planes with an empty table that the workers
fill. It drops a member that has not answered its stats polls for
``--member-timeout-seconds`` (a pod killed without a drain). With an ``autoscaling:``
section in ``--config`` it runs pdserve's controller in observe-only mode: decisions are
logged and exported as ``pdserve:autoscaler_desired_replicas``, and KEDA or an HPA owns the
worker counts. On SIGTERM it drains like ``pdserve serve``.

``--health-port`` serves a plain HTTP ``/health`` for the kubelet, which cannot present the
client certificate that the gRPC health service asks for under mTLS: 200 while the worker
serves, 503 once it drains.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import socket
import sys
from typing import Callable

from pdserve.cluster.plain_process import engine_config, internal_tls, stop_signal
from pdserve.cluster.serve_config import served_names
from pdserve.cluster.settings import (Setting, SettingsError, add_arguments, check_lease_outlives_transfer,
                                      resolve_values, serve_settings)
from pdserve.cluster.typed_settings import WorkerSettings

log = logging.getLogger(__name__)
ROLES = ("prefill", "decode", "router")

_SHARED = ("model", "served_model_name", "dtype", "load_format", "cuda_graphs", "tensor_parallel_size", "block_size", "kv_cache_gib", "kv_cache_memory",
           "gpu_memory_utilization", "max_model_len", "speculative_config", "max_num_seqs", "max_num_batched_tokens",
           "kv_transfer_backend", "lease_seconds",
           "transfer_timeout_seconds", "verify_kv_transfers",
           "drain_grace_seconds", "threads_per_worker", "step_trace_dir", "otlp_traces_endpoint", "host", "port", "grpc_port", "advertise_host",
           "internal_host", "internal_advertise_host", "api_key", "api_key_file", "api_keys_file", "tls_ca", "tls_cert", "tls_key",
           "insecure_internal", "public_tls_cert", "public_tls_key", "public_tls_ca", "admission_wait_seconds", "request_timeout_seconds",
           "prefill_call_min_seconds",
           "max_waiting_requests", "decode_idle_timeout_seconds", "max_body_bytes", "max_prompt_chars",
           "routing_policy", "routing_prefill_weight", "routing_tier_weight", "routing_load_weight", "routing_temperature",
           "routing_balance_abs_tokens", "routing_balance_rel",
           "local_prefill_max_tokens", "local_prefill_max_load", "stream_kv_min_tokens",
           "local_prefill_interference_weight", "kv_move_weight", "remote_overhead_tokens", "decode_kv_reuse",
           "mixed_prefill_tokens", "mixed_step_target_s",
           "prefill_overflow_s", "prefill_overflow_slowdown",
           "enable_lora", "lora_modules", "max_loras", "max_lora_rank", "allow_runtime_lora_updating",
           "kv_offload_bytes", "kv_offload_dir")


@functools.cache
def worker_settings() -> tuple[Setting, ...]:
    """The settings of ``pdserve worker``: ``pdserve serve``'s that one process needs, and its own."""
    return (
        Setting("role", str, None, "which role this process serves", ROLES),
        *(s for s in serve_settings() if s.name in _SHARED),
        Setting("internal_port", int, 0, "internal plane port: a worker's gRPC, the router's RouterAdmin (0: any)"),
        Setting("metrics_port", int, 0, "a worker's Prometheus /metrics port, on the internal host (0: any)"),
        Setting("health_port", int, None, "plain HTTP /health for probes on the internal host (default: off)"),
        Setting("worker_id", str, None, "a worker's name in stats and metrics (default: the host name)"),
        Setting("router_admin", str, None, "a worker joins the router's membership here (its internal host:port)"),
        Setting("join_interval_seconds", float, 5.0, "how often a worker checks that it is in the router's table"),
        Setting("member_timeout_seconds", float, 30.0, "the router drops a worker that has not answered this long"),
        Setting("max_connection_age_seconds", float, 5.0,
                "the router sends each gRPC client connection GOAWAY at this age (the client reconnects, through "
                "its Service, to any router); on SIGTERM it serves this long again, so that every client has "
                "left before it stops (0: never; a call that meets the stop may then fail CANCELLED)", minimum=0),
        Setting("device", str, None, "a prefill or decode worker's device: cpu, cuda or cuda:N, N counted among "
                "the GPUs CUDA_VISIBLE_DEVICES leaves this process (default: the first of those where there is "
                "one, else the CPU)"),
        Setting("reader_tp", int, 1, "a prefill or decode worker's readers' tensor-parallel size: the other pool's "
                "--tensor-parallel-size (a prefill worker's decode pool; a decode worker's prefill pool, which reads "
                "its held prefixes); each KV block is checksummed by groups of heads so that each reader rank checks "
                "what it reads. It and --tensor-parallel-size must divide one another", minimum=1),
    )


def add_worker_parser(sub, settings: bool = True) -> None:
    p = sub.add_parser("worker", help="run one role (prefill, decode or router) as a plain process, without Ray",
                       description=__doc__.split("\n\n")[0] + " Settings come from flags, PDSERVE_* variables "
                                   "and --config FILE.yaml, in that order of precedence.")
    if settings:  # without: another command runs (see pdserve.cli.main)
        add_arguments(p, worker_settings())


def run_worker(args: argparse.Namespace) -> int:
    """Entry of ``pdserve worker``: read the settings, serve the role until SIGTERM."""
    from pdserve.cluster.autoscaling import AutoscaleConfigError
    from pdserve.router.auth import ApiKeyError
    from pdserve.wire import tls

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from pdserve.engine.kernels.cpu_kernels import KernelPathError, check_requested_isa

    try:
        s = settings(args)
        if s.role != "router":
            check_requested_isa()
        if s.role == "router":  # every config is built, and checked, before anything starts
            from pdserve.cluster.worker_router import autoscaling, router_config, run_router

            coro = run_router(s, router_config(s), autoscaling(s))
        else:
            coro = run_role(s, worker_config(s))
    except (SettingsError, AutoscaleConfigError, ApiKeyError, tls.TlsConfigError, KernelPathError) as exc:
        print(f"pdserve worker: {exc}", file=sys.stderr)
        return 2
    asyncio.run(coro)
    return 0


def settings(args: argparse.Namespace, environ=None) -> WorkerSettings:
    """The typed settings, checked for what the role needs. A setting of ``pdserve serve`` that
    this table leaves out (``--seed``, ``--max-num-seqs`` ...) keeps serve's default."""
    import os

    values = resolve_values(args, os.environ if environ is None else environ, worker_settings())
    if values["role"] is None:
        raise SettingsError("role: required (--role prefill|decode|router, or PDSERVE_ROLE)")
    s = WorkerSettings.from_values(values, defaults={setting.name: setting.default for setting in serve_settings()})
    if s.role != "router" and not s.plain.router_admin:
        raise SettingsError(f"router_admin: a {s.role} worker needs the router's internal address to join "
                            "(--router-admin HOST:PORT, or PDSERVE_ROUTER_ADMIN)")
    if s.role != "router":  # each side checks the pair as it is given: both read one config in a deployment
        check_lease_outlives_transfer(s.kv.lease_seconds, s.kv.transfer_timeout_seconds)
        check_reader_tp(s.plain.reader_tp, s.engine.tensor_parallel_size)
    return s


def check_reader_tp(reader_tp: int, tensor_parallel_size: int) -> None:
    """KV moves by head only between sizes where one divides the other (kv_transfer.sharding):
    refuse, at start, a reader size this worker could never serve."""
    if reader_tp % tensor_parallel_size and tensor_parallel_size % reader_tp:
        raise SettingsError(f"reader_tp: {reader_tp} (--reader-tp) and tensor_parallel_size {tensor_parallel_size} "
                            "(--tensor-parallel-size) must divide one another: KV moves by head only between such "
                            "sizes")


def worker_config(s: WorkerSettings):
    """The role's frozen config from the settings."""
    internal, kv = s.internal, s.kv
    common = dict(worker_id=s.plain.worker_id or socket.gethostname(),
                  model_name=served_names(s.engine.model, s.api.served_model_name)[0],
                  engine=engine_config(s), host=internal.internal_host,
                  advertise_host=internal.internal_advertise_host, tls=joining_tls(s),
                  port=s.plain.internal_port, insecure_internal=internal.insecure_internal,
                  metrics_port=s.plain.metrics_port, kv_transfer_backend=kv.kv_transfer_backend,
                  verify_kv=kv.verify_kv_transfers, reader_tp=s.plain.reader_tp,
                  step_trace_dir=s.process.step_trace_dir, otlp_traces_endpoint=s.process.otlp_traces_endpoint)
    if s.role == "prefill":
        from pdserve.prefill_worker.config import PrefillWorkerConfig

        return PrefillWorkerConfig(lease_seconds=kv.lease_seconds, **common)
    from pdserve.decode_worker.worker import DecodeWorkerConfig

    return DecodeWorkerConfig(transfer_timeout_s=kv.transfer_timeout_seconds, lease_seconds=kv.lease_seconds,
                              decode_kv_reuse=s.router.decode_kv_reuse, **common)


def joining_tls(s: WorkerSettings):
    """The worker's certificate, checked to name its role and the host it advertises: the router
    lets a worker join its table only at a host its certificate names (``pdserve.router.admin``),
    so a certificate that does not would fail every Join; refused at start instead."""
    from pdserve.wire import tls
    from pdserve.wire.address import resolve

    config = internal_tls(s.internal, s.role)
    if config is None:
        return None
    host = resolve(s.internal.internal_host, s.internal.internal_advertise_host).advertise_host
    if not tls.names_host(config.cert_pem, host):
        hosts = ", ".join(sorted(tls.certificate_hosts(config.cert_pem))) or "no host"
        raise tls.TlsConfigError(f"tls_cert: the certificate names {hosts}, not {host}, the host this worker "
                                 f"advertises (internal_advertise_host); the router lets a worker join only at "
                                 f"a host its own certificate names: python -m pdserve.cluster.certs DIR "
                                 f"--worker NAME={s.role}@{host}")
    return config


async def run_role(s: WorkerSettings, config) -> None:
    """Serve a prefill or decode worker, keep it in the router's table, and on SIGTERM leave
    the table, then drain."""
    import torch

    if s.process.threads_per_worker:
        torch.set_num_threads(s.process.threads_per_worker)
    if s.role == "prefill":
        from pdserve.prefill_worker.server import start
    else:
        from pdserve.decode_worker.server import start
    running = await start(config)
    membership = Membership(s.plain.router_admin, config.tls, s.role, running.address, config.worker_id)
    health = Health(lambda: membership.joined)
    runner = await health.serve(config.host, s.plain.health_port) if s.plain.health_port is not None else None
    keeper = asyncio.create_task(membership.keep_joined(s.plain.join_interval_seconds))
    print(f"listening on {running.address}", flush=True)
    await stop_signal()
    health.draining = True
    keeper.cancel()
    grace_s = s.process.drain_grace_seconds
    print(f"draining (grace {grace_s:g} s)", flush=True)
    await membership.leave()
    await running.drain(grace_s)
    if runner is not None:
        await runner.cleanup()


class Health:
    """The plain HTTP ``/health`` of a worker (its readiness): 503 until it is in the router's
    table (``joined()``), then 200 until it drains, then 503. A worker's only traffic comes
    through the router, so a rolling update must not count a new pod ready, and stop an old
    one, before the router can send the new one anything."""

    ROUTES = ("/health",)

    def __init__(self, joined: Callable[[], bool] = lambda: True) -> None:
        self.draining = False
        self.joined = joined

    async def serve(self, host: str | None, port: int):
        from aiohttp import web

        from pdserve.wire.address import resolve as resolve_host

        app = web.Application()
        app.add_routes([web.get("/health", self._health)])
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, resolve_host(host).bind_host, port).start()
        return runner

    async def _health(self, request):
        from aiohttp import web

        if self.draining:
            return web.Response(status=503, text="draining\n")
        if not self.joined():
            return web.Response(status=503, text="not yet in the router's table\n")
        return web.Response(text="serving\n")


class Membership:
    """A worker's entry in the router's table, kept through ``RouterAdmin`` on the internal plane.

    ``Join`` and ``Leave`` change this worker's entry alone, under the role its certificate
    names and at a host it names (the router refuses any other, and only the controller may
    replace the table)."""

    def __init__(self, admin_address: str, tls, role: str, address: str, worker_id: str):
        from pdserve.protos import admin_pb2

        self.admin_address, self.tls = admin_address, tls
        self.member = admin_pb2.Member(role=role, address=address, worker_id=worker_id)
        self.joined = False  # the router's table has listed this worker (set once, by keep_joined)

    async def _update(self, present: bool, timeout_s: float = 5.0) -> bool:
        """Make this worker present in (or absent from) the table; True if it had to change."""
        from pdserve.protos import admin_pb2_grpc
        from pdserve.wire.grpc_util import aio_channel

        async with aio_channel(self.admin_address, self.tls, peer="router") as ch:
            stub = admin_pb2_grpc.RouterAdminStub(ch)
            ack = await (stub.Join if present else stub.Leave)(self.member, timeout=timeout_s)
            return ack.changed

    async def join(self) -> bool:
        return await self._update(True)

    async def leave(self) -> None:
        import grpc

        try:
            await self._update(False)
        except grpc.RpcError as exc:  # the router is gone too: nobody routes to us anyway
            log.warning("could not leave the router's table at %s: %s", self.admin_address, exc.code().name)

    async def keep_joined(self, interval_s: float) -> None:
        import grpc

        while True:
            try:
                if await self.join():
                    log.info("joined the router at %s as %s %s", self.admin_address, self.member.role,
                             self.member.address)
                self.joined = True  # listed now: added just now, or found there
            except grpc.RpcError as exc:  # the router is starting or restarting: try again
                if exc.code() is grpc.StatusCode.PERMISSION_DENIED:  # it will not list us: say why, loudly
                    log.error("the router at %s refuses to list this worker: %s", self.admin_address, exc.details())
                else:
                    log.warning("router at %s not reachable: %s", self.admin_address, exc.code().name)
            await asyncio.sleep(interval_s)
