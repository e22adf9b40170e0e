"""Faults under a steady load at two tensor-parallel ranks per worker: the tiny model with the
default tokenizer (``tests.serving.test_tensor_parallel``), so that a process killed or stopped
is a worker's rank 0 and its other rank leaves with it, and then the router's death. What is
caused and checked is ``tests.helpers.under_load``'s.

This is the fault-injection conformance suite's run under load (docs/reliability.md): the same
faults also ran at one rank per worker on the conformance cluster until 2026-12-01, a second
proof of the same promise (about 70 s). At one rank a worker is its rank 0 alone, so the run
here, where rank 0 is what is killed, stopped or signalled and its follower must go with it,
proves every step of that one and more; the router runs no ranks, so its death is the same at
either size."""

import pytest

from tests.clusters import cluster_config, reconnecting_stub, running_cluster
from tests.helpers.under_load import (HANG_S, LEASE_S, READ_DELAY_S, lose_nothing_under_faults,
                                      sigterm_drains_then_replaced)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tool_llama):
    from pdserve.engine.config import CacheConfig, EngineConfig

    engine = EngineConfig(model=str(tool_llama[0]), dtype="float32", cache=CacheConfig(memory_budget_bytes=96 << 20))
    with running_cluster(cluster_config(
            dtype="float32", num_prefill=2, num_decode=2, http_port=None, lease_seconds=LEASE_S,
            kv_transfer_backend="tcp", inject_transfer_delay_s=READ_DELAY_S, router_poll_s=0.2,
            supervise_interval_s=0.5, hang_timeout_s=HANG_S, engine=engine, prefill_tp=2, decode_tp=2)) as c:
        yield c


@pytest.fixture(scope="module")
def stub(cluster):
    with reconnecting_stub(cluster.address) as stub:
        yield stub


def test_nothing_is_lost_under_faults_and_steady_load(cluster, stub):
    lose_nothing_under_faults(cluster, stub)


def test_sigterm_drains_a_ray_worker_actor_then_it_is_replaced(cluster, stub):
    sigterm_drains_then_replaced(cluster, stub)
