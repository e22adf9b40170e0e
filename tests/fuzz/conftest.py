"""A live cluster for the fuzz and overload tests: Ray actors, gRPC, NIXL, the default model.

The lease is far longer than any check here waits, so "every block is free" cannot pass by
lease expiry alone. A small ``max_waiting_requests`` lets the overload test fill the router.
"""

import time

import pytest

from pdserve.router.limits import RouterLimits
from tests.clusters import cluster_config, running_cluster
from tests.serving.conftest import all_stats

LEASE_S = 120.0
MAX_WAITING = 3
REQUEST_TIMEOUT_S = 60.0


@pytest.fixture(scope="package")
def cluster():
    with running_cluster(cluster_config(
            kv_mib=192, lease_seconds=LEASE_S,
            router_limits=RouterLimits(max_waiting_requests=MAX_WAITING, request_timeout_s=REQUEST_TIMEOUT_S,
                                       admission_wait_s=10.0))) as c:
        yield c


def held(cluster) -> dict[str, tuple[int, int]]:
    """Each worker's blocks in use and leases held, where either is not zero."""
    return {s.worker_id: (s.num_blocks_used, s.num_held_leases) for s in all_stats(cluster)
            if s.num_blocks_used or s.num_held_leases}


def assert_all_blocks_free(cluster, timeout_s: float = 10.0, before: dict[str, tuple[int, int]] | None = None) -> None:
    """No worker holds a block or a lease within ``timeout_s`` (< LEASE_S: not by expiry) beyond
    what it held ``before`` (``held``, taken before the requests under test): the internal
    fuzz's Prefills that nobody claims hold their KV for the whole lease, as they should."""
    before = before or {}
    deadline = time.monotonic() + timeout_s
    while True:
        busy = {w: (blocks, leases) for w, (blocks, leases) in held(cluster).items()
                if blocks > before.get(w, (0, 0))[0] or leases > before.get(w, (0, 0))[1]}
        if not busy:
            return
        assert time.monotonic() < deadline, f"blocks still in use: {busy} (held before: {before})"
        time.sleep(0.2)


def assert_no_process_died(cluster) -> None:
    import ray

    for actor in [cluster.router, *cluster.prefill, *cluster.decode]:
        ray.get(actor.pid.remote(), timeout=30)
    assert cluster._supervisor is None or cluster._supervisor.replaced == 0
