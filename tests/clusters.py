"""The one way tests start a real local cluster (Ray actors, gRPC, NIXL or tcp, the default
model): ``cluster_config`` gives the test defaults, ``running_cluster`` starts it and always
stops it, even when the start fails half-way (a half-started Ray would outlive the module)."""

from __future__ import annotations

import contextlib
import dataclasses
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


@contextlib.contextmanager
def running_cluster(config: ClusterConfig) -> Iterator[LocalCluster]:
    cluster = LocalCluster(config)
    try:
        cluster.start()
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
