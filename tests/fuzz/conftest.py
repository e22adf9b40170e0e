"""A live cluster for the fuzz and overload tests: Ray actors, gRPC, NIXL, the default model.

The lease is far longer than any check here waits, so "every block is free" cannot pass by
lease expiry alone. A small ``max_waiting_requests`` lets the overload test fill the router.
"""

import time

import pytest

from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.local import LocalCluster
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.router.limits import RouterLimits
from tests.serving.conftest import all_stats

LEASE_S = 120.0
MAX_WAITING = 3
REQUEST_TIMEOUT_S = 60.0


@pytest.fixture(scope="package")
def cluster():
    config = ClusterConfig(
        engine=EngineConfig(cache=CacheConfig(memory_budget_bytes=192 << 20)), num_prefill=1, num_decode=1,
        grpc_port=0, http_port=0, lease_seconds=LEASE_S, threads_per_worker=1,
        router_limits=RouterLimits(max_waiting_requests=MAX_WAITING, request_timeout_s=REQUEST_TIMEOUT_S,
                                   admission_wait_s=10.0))
    c = LocalCluster(config)
    c.start()
    yield c
    c.stop()


def assert_all_blocks_free(cluster, timeout_s: float = 10.0) -> None:
    """No worker holds a block or a lease within ``timeout_s`` (< LEASE_S: not by expiry)."""
    deadline = time.monotonic() + timeout_s
    while True:
        busy = {s.worker_id: (s.num_blocks_used, s.num_held_leases) for s in all_stats(cluster)
                if s.num_blocks_used or s.num_held_leases}
        if not busy:
            return
        assert time.monotonic() < deadline, f"blocks still in use: {busy}"
        time.sleep(0.2)


def assert_no_process_died(cluster) -> None:
    import ray

    for actor in [cluster.router, *cluster.prefill, *cluster.decode]:
        ray.get(actor.pid.remote(), timeout=30)
    assert cluster._supervisor is None or cluster._supervisor.replaced == 0
