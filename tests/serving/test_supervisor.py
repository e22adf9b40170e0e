"""A killed worker process is replaced by the controller, and the router stops sending it
work within seconds, because the controller, not a static list, sets the router's members."""

import os
import signal
import threading
import time

import grpc
import pytest
import ray

from pdserve.protos import admin_pb2, admin_pb2_grpc, pdserve_pb2_grpc
from tests.serving.conftest import start_cluster, worker_stats
from tests.serving.test_disaggregated import chat_request, collect

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    c = start_cluster(num_prefill=1, num_decode=2, delay_s=0.0, supervise_interval_s=0.5)
    yield c
    c.stop()


def router_members(cluster) -> set[tuple[str, str]]:
    with grpc.insecure_channel(cluster.admin_address) as ch:  # RouterAdmin is on the internal plane only
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


def test_scale_down_drains_without_a_client_error_and_scale_up_joins(cluster):
    question = "Write a long story about a lighthouse keeper."
    with grpc.insecure_channel(cluster.address) as ch:
        stub = pdserve_pb2_grpc.GenerationStub(ch)
        reference, _, _ = collect(stub.Generate(chat_request(question, 60, ignore_eos=True), timeout=120))
        stream = stub.Generate(chat_request(question, 60, ignore_eos=True), timeout=120)
        got = list(next(stream).token_ids)  # from the prefill worker; the decode side starts now
        serving = None
        deadline = time.monotonic() + 10
        while serving is None and time.monotonic() < deadline:
            busy = [i for i, a in enumerate(cluster.decode_addresses) if worker_stats(a, "decode").num_running]
            serving = busy[0] if busy else None
            time.sleep(0.05)
        assert serving is not None, "no decode worker took the stream"

        done = {}
        drain = threading.Thread(target=lambda: done.setdefault("address", cluster.scale_down("decode", serving)))
        drain.start()
        got += collect(stream)[0]  # the draining worker finishes this stream
        drain.join(60)
        assert got == reference and done["address"] not in cluster.decode_addresses
        assert len(cluster.decode) == 1 and ("decode", done["address"]) not in router_members(cluster)
        added = cluster.scale_up("decode")
        assert ("decode", added) in router_members(cluster) and len(cluster.decode) == 2
        for i in range(4):
            assert collect(stub.Generate(chat_request(f"Name a color, {i}.", 6), timeout=120))[0]
