"""Rolling restarts under a steady load (``pdserve.cluster.rollout``): the prefill worker
(a pool of one: never a moment without one), then each of the two decode workers in turn,
then the router is replaced while clients keep greedy streams running. Every stream completes with exactly the tokens of an undisturbed run, none
fails, the graceful drains migrate nothing, and afterwards no worker holds a KV block.

A decode worker that must stop before its streams are done (a grace of 0) hands them over:
they migrate and still complete with the same tokens.

Then, on the same cluster (its own start would cost as much as these tests): a killed worker
process is replaced by the controller, and the router stops sending it work within seconds,
because the controller, not a static list, sets the router's members; a scale-down drains
without a client error and a scale-up joins.

The cluster runs the real default model in float32, so outputs compare token for token.
"""

import os
import signal
import threading
import time

import grpc
import pytest
import ray

from pdserve.cluster.rollout import RolloutConfig, roll
from pdserve.protos import admin_pb2, admin_pb2_grpc, pdserve_pb2_grpc
from tests.clusters import cluster_config, reconnecting_stub, running_cluster
from tests.faults.load import Load
from tests.helpers.chat import chat_request, collect
from tests.helpers.faults import assert_no_kv_held, busy, check, greedy_at_once, gone, migrations
from tests.serving.conftest import worker_stats

pytestmark = pytest.mark.slow

LEASE_S = 120.0  # far beyond every wait here: a freed block was freed on purpose, not by expiry
REQUEST_TIMEOUT_S = 60.0
CLIENTS = 3
MAX_TOKENS = 16
LONG_TOKENS = 32  # streams still running when a worker with no grace stops
PROMPTS = [f"Tell me a short fact about the number {i}." for i in range(3)]
GRACEFUL = RolloutConfig(drain_grace_s=60.0, unready_s=0.5, ready_timeout_s=120.0)


@pytest.fixture(scope="module")
def cluster():
    with running_cluster(cluster_config(dtype="float32", num_decode=2, lease_seconds=LEASE_S, router_poll_s=0.2,
                                        supervise_interval_s=0.5)) as c:
        yield c


@pytest.fixture(scope="module")
def stub(cluster):
    with reconnecting_stub(cluster.address) as stub:  # the next call after a GOAWAY reaches the new router
        yield stub


@pytest.fixture(scope="module")
def reference(stub):
    """Each prompt's greedy tokens from the undisturbed cluster, for ``MAX_TOKENS`` and
    ``LONG_TOKENS`` (greedy with ignore_eos: the shorter run is the longer one's beginning)."""
    out = {}
    for i, ids in enumerate(greedy_at_once(stub, PROMPTS, LONG_TOKENS)):
        assert len(ids) == LONG_TOKENS
        out[(i, LONG_TOKENS)], out[(i, MAX_TOKENS)] = ids, ids[:MAX_TOKENS]
    return out


def pids(cluster) -> dict[str, int]:
    actors = {"router": [cluster.router], "prefill": cluster.prefill, "decode": cluster.decode}
    return {f"{role}:{i}": ray.get(a.pid.remote(), timeout=10) for role, group in actors.items()
            for i, a in enumerate(group)}


def test_rolling_each_pool_and_the_router_loses_no_request(cluster, stub, reference):
    before = {"prefill": list(cluster.prefill_addresses), "decode": list(cluster.decode_addresses)}
    old_pids = pids(cluster)
    address = cluster.address
    drains = []  # (pool, when the old process's drain began)
    with Load(stub, PROMPTS, MAX_TOKENS, CLIENTS, REQUEST_TIMEOUT_S) as load:
        load.wait_for(CLIENTS)
        for pool in ("prefill", "decode"):
            migrated = migrations(cluster)
            start = time.monotonic()
            done = roll(cluster, pool, GRACEFUL)
            assert [d.old for d in done] == before[pool]
            assert all(d.idle for d in done), done
            # the drains, each right after its surge, in the order they ran
            t = start
            for d in done:
                drains.append((pool, t + d.surge_s))
                t += d.surge_s + d.drain_s
            assert migrations(cluster) == migrated, f"a graceful {pool} drain migrated streams"
            load.wait_for(CLIENTS)
        start = time.monotonic()
        [done] = roll(cluster, "router", GRACEFUL)
        assert done.idle
        drains.append(("router", start + done.surge_s))
        load.wait_for(2 * CLIENTS)  # served by the new router

    check(load.outcomes, reference, MAX_TOKENS)
    for pool, t in drains:  # each old process had streams to finish when its drain began
        assert load.spanning(t) >= 1, f"no request was running when a {pool} drain began"
    after = {"prefill": cluster.prefill_addresses, "decode": cluster.decode_addresses}
    for pool in ("prefill", "decode"):
        assert len(after[pool]) == len(before[pool]) and not set(after[pool]) & set(before[pool])
    assert cluster.address == address  # clients kept their address
    new_pids = set(pids(cluster).values())
    for name, pid in old_pids.items():
        assert pid not in new_pids and gone(pid), f"the old {name} process lives on"
    assert_no_kv_held(cluster)


def test_a_decode_worker_out_of_grace_hands_its_streams_over(cluster, stub, reference):
    """Grace 0: the old decode worker stops with streams running; they migrate and complete."""
    migrated = migrations(cluster)
    old = list(cluster.decode_addresses)
    cluster.scale_up("decode")  # the surge, so the pool keeps its size
    with Load(stub, PROMPTS, LONG_TOKENS, CLIENTS, REQUEST_TIMEOUT_S) as load:
        victim = busy(old)
        assert cluster.retire("decode", victim, drain_timeout_s=0.0) is False  # stopped busy
        load.wait_for(2 * CLIENTS)
    check(load.outcomes, reference, LONG_TOKENS)
    assert migrations(cluster) > migrated
    assert victim not in cluster.decode_addresses and len(cluster.decode_addresses) == 2
    assert_no_kv_held(cluster)


# ---- the supervisor and scaling (after the rollouts: they start from the cluster as it is) ----

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
