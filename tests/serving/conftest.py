"""A real local cluster for the serving tests: Ray actors, gRPC, NIXL, the default model."""

import time

import grpc
import pytest

from pdserve.cluster.local import LocalCluster
from pdserve.protos import pdserve_pb2_grpc, worker_pb2, worker_pb2_grpc
from pdserve.router.limits import RouterLimits
from tests.clusters import cluster_config, start_local_cluster

# While a test holds KV reads back (tests.helpers.faults.reads_delayed, the fault-injection hook
# of kv_transfer), each waits this long, so that it sees the first token arrive before the
# decode worker has its KV. Every other request on the shared cluster reads at once.
TRANSFER_DELAY_S = 0.5
LEASE_S = 4.0
# A held-back read takes TRANSFER_DELAY_S; a lease must outlive the longest read (ClusterConfig).
TRANSFER_TIMEOUT_S = 3.0


def start_cluster(num_prefill: int = 2, num_decode: int = 2, delay_s: float = 0.0,
                  router_poll_s: float = 0.2, supervise_interval_s: float | None = 1.0,
                  admission_wait_s: float = RouterLimits.admission_wait_s, **overrides) -> LocalCluster:
    """``delay_s``: every KV read of the cluster's life posted that long after its claim
    (``inject_transfer_delay_s``); ``overrides``: further ``ClusterConfig`` fields (``mode``,
    ``router_limits``)."""
    # float32, the transformers-exact mode: served output is checked token for token against
    # transformers (bfloat16, the default, is checked in tests/engine/test_default_model.py).
    config = cluster_config(**{
        "dtype": "float32", "kv_mib": 192, "num_prefill": num_prefill, "num_decode": num_decode,
        "lease_seconds": LEASE_S, "transfer_timeout_s": TRANSFER_TIMEOUT_S, "inject_transfer_delay_s": delay_s,
        "router_poll_s": router_poll_s, "supervise_interval_s": supervise_interval_s,
        "router_limits": RouterLimits(admission_wait_s=admission_wait_s), **overrides})
    return start_local_cluster(config)


@pytest.fixture(scope="package")
def cluster():
    """2 prefill + 2 decode workers, shared by the serving tests (test_faults has its own)."""
    c = start_cluster()
    yield c
    c.stop()


@pytest.fixture(scope="package")
def channel(cluster):
    with grpc.insecure_channel(cluster.address) as ch:
        yield ch


@pytest.fixture(scope="package")
def stub(channel):
    return pdserve_pb2_grpc.GenerationStub(channel)


def worker_stats(address: str, role: str) -> worker_pb2.WorkerStats:
    with grpc.insecure_channel(address) as ch:
        cls = worker_pb2_grpc.PrefillWorkerStub if role == "prefill" else worker_pb2_grpc.DecodeWorkerStub
        return cls(ch).Stats(worker_pb2.StatsRequest(), timeout=5)


def all_stats(cluster) -> list[worker_pb2.WorkerStats]:
    return ([worker_stats(a, "prefill") for a in cluster.prefill_addresses]
            + [worker_stats(a, "decode") for a in cluster.decode_addresses])


def assert_all_blocks_free(cluster, timeout_s: float = 10.0) -> None:
    """Every worker's blocks free and no lease held (prefill frees on NIXL's notification)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = all_stats(cluster)
        busy = {s.worker_id: (s.num_blocks_used, s.num_held_leases) for s in stats
                if s.num_blocks_used or s.num_held_leases}
        if not busy:
            return
        assert time.monotonic() < deadline, f"blocks still in use: {busy}"
        time.sleep(0.1)
