"""The one way tests start a real local cluster (Ray actors, gRPC, NIXL or tcp, the default
model): ``cluster_config`` gives the test defaults, ``running_cluster`` starts it and always
stops it, even when the start fails half-way (a half-started Ray would outlive the module).

Every such cluster joins the test process's one Ray (``shared_ray``) instead of starting and
ending one of its own: about 4 s a cluster on a quiet machine, 10 s and more under load. A test
whose driver joins another Ray (``ray start``) calls ``leave_shared_ray`` first. A cluster
starting a Ray of its own is what every ``pdserve serve`` a test runs does (tests/cluster/test_cli.py
and others)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Iterator

import grpc

from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.local import LocalCluster
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.protos import pdserve_pb2_grpc


def cluster_config(*, dtype: str | None = None, kv_mib: int = 96, prefill_tp: int | None = None,
                   decode_tp: int | None = None, **fields) -> ClusterConfig:
    """One prefill and one decode worker on a core each, with ``kv_mib`` of KV cache each, the
    router on free ports; ``fields`` are further ``ClusterConfig`` fields. ``dtype`` None is the
    engine's default (bfloat16); float32 is the transformers-exact mode. ``prefill_tp`` and
    ``decode_tp``: each pool's engine at that tensor-parallel size (as ``pdserve serve`` builds
    them, ``ClusterConfig.prefill_engine`` and ``decode_engine``)."""
    engine = EngineConfig(dtype=dtype, cache=CacheConfig(memory_budget_bytes=kv_mib << 20))
    fields = {"engine": engine, "num_prefill": 1, "num_decode": 1, "grpc_port": 0, "http_port": 0,
              "threads_per_worker": 1, **fields}
    for pool, size in (("prefill_engine", prefill_tp), ("decode_engine", decode_tp)):
        if size is not None:
            fields[pool] = dataclasses.replace(fields["engine"], tensor_parallel_size=size)
    return ClusterConfig(**fields)


def shared_ray() -> None:
    """Start the test process's Ray unless one runs, as a cluster starts its own
    (``pdserve.cluster.ray_start``: token auth, room for every worker); a cluster started after
    it finds it running and joins it. Its workers are then not pinned to cores (a cluster pins
    only in a Ray it started itself): pinning is tested in tests/cluster/test_mode_settings.py;
    a cluster that starts its own Ray is every ``pdserve serve`` a test runs."""
    import ray

    from pdserve.cluster.ray_start import LOCAL_RAY_MIN_CPUS, start_local_ray

    if ray.is_initialized() and _lost():
        ray.shutdown()
    if not ray.is_initialized():
        start_local_ray(max(os.cpu_count() or 1, LOCAL_RAY_MIN_CPUS), token_auth=True)


def _lost() -> bool:
    """Whether the Ray this process started has lost its GCS server or raylet since (a `ray stop
    --force` on this machine ends them all), as ``LocalCluster.ray_lost`` asks of its own."""
    import ray

    node = getattr(ray._private.worker, "_global_node", None)
    return node is not None and any(info.process.poll() is not None for kind in ("gcs_server", "raylet")
                                    for info in node.all_processes.get(kind, []))


def leave_shared_ray() -> None:
    """End the shared Ray, if one runs: for a test whose driver joins a Ray of its own making
    (``ray start``) or whose cluster must start its own. The next shared cluster starts one again."""
    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            ray.shutdown()


def start_local_cluster(config: ClusterConfig) -> LocalCluster:
    """``config``'s cluster, started in the shared Ray (unless it names a ``ray_address``), or
    stopped again if its start fails half-way; the caller stops it."""
    if config.ray_address is None:
        shared_ray()
    cluster = LocalCluster(config)
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    return cluster


@contextlib.contextmanager
def running_cluster(config: ClusterConfig) -> Iterator[LocalCluster]:
    """``start_local_cluster`` for a ``with`` block: stopped at its end."""
    cluster = start_local_cluster(config)
    try:
        yield cluster
    finally:
        cluster.stop()


@contextlib.contextmanager
def reconnecting_stub(address: str) -> Iterator[pdserve_pb2_grpc.GenerationStub]:
    """A client that reconnects within a second when its router goes and comes back (gRPC's
    default backoff grows to minutes after failures)."""
    options = [("grpc.max_reconnect_backoff_ms", 1000), ("grpc.initial_reconnect_backoff_ms", 200)]
    with grpc.insecure_channel(address, options=options) as channel:
        yield pdserve_pb2_grpc.GenerationStub(channel)
