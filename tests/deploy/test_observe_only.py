"""The controller in observe-only mode (plain Kubernetes, where KEDA owns the counts): it
decides, exports and logs as usual, but never starts or drains a worker, and a decision it
did not carry out does not hold the pool as "pending" (its advice keeps up with the load)."""

import asyncio
from concurrent import futures
from types import SimpleNamespace

import grpc

from pdserve.cluster.autoscaler import Autoscaler
from pdserve.cluster.autoscaling import PoolSample, from_mapping
from pdserve.cluster.worker_router import ObservedCluster
from pdserve.protos import admin_pb2, admin_pb2_grpc

FAST = {"window_s": 3, "scale_up_cooldown_s": 0, "scale_down_cooldown_s": 0, "max_replicas": 8}


class WatchedCluster:
    """What the autoscaler sees of a cluster; it must never be asked to change one."""

    config = SimpleNamespace(tls=None)
    admin_address = "unused:1"

    def __init__(self):
        self.scaler = None
        self.exported = []  # what the router's desired-replicas gauge was told, per push
        self.changes = []

    def addresses(self, pool):
        return []

    def push_membership(self):
        self.exported.append(self.scaler.desired()["prefill"])

    def scale_up(self, pool):
        self.changes.append(("up", pool))

    def scale_down(self, pool, *args):
        self.changes.append(("down", pool))


def run(observe_only: bool, rounds: int = 12) -> tuple[Autoscaler, WatchedCluster]:
    cluster = WatchedCluster()
    scaler = Autoscaler(cluster, from_mapping({"prefill": FAST, "decode": FAST}), observe_only=observe_only)
    cluster.scaler = scaler
    scaler._latency = lambda window_s: None  # no router here
    # One prefill worker far over its target, one idle decode worker, every round.
    scaler.sample = lambda pool, now, latency=None: (PoolSample(now, 1, queued_prompt_tokens=100_000)
                                                     if pool == "prefill" else PoolSample(now, 1, kv_usage=0.0))
    for t in range(rounds):
        scaler.step(float(t))
    for action in scaler._actions.values():
        action.join(5)
    return scaler, cluster


def test_observe_only_decides_and_exports_but_never_scales():
    scaler, cluster = run(observe_only=True)
    ups = [d for d in scaler.traces["prefill"].decisions if d.action == "up"]
    assert len(ups) >= 2  # a decision nobody carries out leaves no pending change behind
    assert all(d.current == 1 and d.desired == 2 for d in ups)  # the pool stayed at 1: nobody acted
    assert cluster.exported.count(2) >= len(ups)  # each reaches the router's desired-replicas gauge
    assert cluster.changes == []


def test_the_acting_controller_scales_and_then_waits_for_the_change():
    scaler, cluster = run(observe_only=False)
    ups = [d for d in scaler.traces["prefill"].decisions if d.action == "up"]
    assert len(ups) == 1 and cluster.changes == [("up", "prefill")]
    assert "pending" in scaler.traces["prefill"].decisions[-1].reason


class _Admin(admin_pb2_grpc.RouterAdminServicer):
    """A plain router's RouterAdmin with an empty table and a known TTFT."""

    def GetMembership(self, request, context):  # noqa: N802 (the RPC's name)
        return admin_pb2.Membership()

    def GetLatency(self, request, context):  # noqa: N802
        return admin_pb2.LatencySummary(ttft_p90_s=0.25, ttft_count=4)


def test_a_plain_routers_controller_reads_its_router_each_round():
    """``pdserve worker --role router`` with an ``autoscaling:`` section (the plain-k8s overlay):
    a round reads the table and the latencies over RouterAdmin, with the router's own TLS
    (None here) for every role it asks as."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    admin_pb2_grpc.add_RouterAdminServicer_to_server(_Admin(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    loop = asyncio.new_event_loop()  # where the router's gauge would be told; never run here
    try:
        cluster = ObservedCluster(f"127.0.0.1:{port}", None, SimpleNamespace(desired_replicas={}), loop)
        scaler = Autoscaler(cluster, from_mapping({"prefill": FAST, "decode": FAST}), observe_only=True)
        cluster.autoscaler = scaler
        scaler.step(0.0)
    finally:
        server.stop(None)
        loop.close()
    [sample] = scaler.traces["prefill"].samples
    assert (sample.replicas, sample.ttft_p90_s) == (0, 0.25)
