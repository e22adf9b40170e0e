"""A killed worker process is replaced by the controller, and the router stops sending it
work within seconds, because the controller, not a static list, sets the router's members."""

import os
import signal
import time

import grpc
import pytest
import ray

from protos import admin_pb2, admin_pb2_grpc, pdserve_pb2_grpc
from tests.serving.conftest import start_cluster, worker_stats
from tests.serving.test_disaggregated import chat_request, collect

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    c = start_cluster(num_prefill=1, num_decode=2, delay_s=0.0, supervise_interval_s=0.5)
    yield c
    c.stop()


def router_members(cluster) -> set[tuple[str, str]]:
    with grpc.insecure_channel(cluster.address) as ch:
        got = admin_pb2_grpc.RouterAdminStub(ch).GetMembership(admin_pb2.Membership(), timeout=5)
    return {(m.role, m.address) for m in got.members}


def test_killed_decode_worker_is_replaced_and_leaves_the_routing_table(cluster):
    old = cluster.decode_addresses[0]
    assert ("decode", old) in router_members(cluster)
    os.kill(ray.get(cluster.decode[0].pid.remote()), signal.SIGKILL)
    killed_at = time.monotonic()
    while ("decode", old) in router_members(cluster):
        assert time.monotonic() - killed_at < 15, "the router still lists the dead worker"
        time.sleep(0.2)
    left_after = time.monotonic() - killed_at
    deadline = time.monotonic() + 90
    while cluster.decode_addresses[0] == old or ("decode", cluster.decode_addresses[0]) not in router_members(cluster):
        assert time.monotonic() < deadline, "no replacement joined"
        time.sleep(0.5)
    new = cluster.decode_addresses[0]
    assert left_after < 15
    with grpc.insecure_channel(cluster.address) as ch:
        stub = pdserve_pb2_grpc.GenerationStub(ch)
        for i in range(4):
            ids, _, _ = collect(stub.Generate(chat_request(f"Say hello number {i}.", 6), timeout=120))
            assert ids
    assert worker_stats(new, "decode").kv_transfers > 0  # the replacement serves
