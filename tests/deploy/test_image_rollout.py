"""`kubectl rollout restart` of each plain-k8s Deployment, in containers, under a steady load:
the prefill pool, then the decode pool, then the router, while clients keep greedy float32
streams running. Every stream completes with the tokens of an undisturbed run, none fails,
nothing migrates, and afterwards no worker holds a KV block or lease.

The pods are test_image.py's, run from the image as the overlay declares them
(tests/deploy/containers.py). Each roll is the Deployment's RollingUpdate with maxSurge 1 and
maxUnavailable 0, step by step as Kubernetes takes it:

1. a new pod of the Deployment starts (same args, environment and mounts);
2. it becomes ready: its readinessProbe (GET /health on the health port for a worker, on the
   HTTP port for the router) answers 200, polled every 0.5 s. Nothing else is waited for: a
   worker's join to the router is its own business, as in Kubernetes;
3. the old pod is deleted: it leaves its Services' endpoints, the kubelet runs its preStop hook
   (a worker's: SIGTERM to pdserve and wait for its exit; the router's: sleep 5), then
   `podman stop --time` with what is left of terminationGracePeriodSeconds (SIGTERM, then
   SIGKILL). Each old pod must exit 0, within its grace.

The Services are modelled by a proxy per Service on the network's gateway address
(tests/deploy/service.py), doing what kube-proxy does for a ClusterIP Service: each new
connection goes to an endpoint picked at random, open connections stay where they are. The
clients use one address throughout, `pdserve-router` (50051); its endpoints are the ready
routers that are not terminating. Workers join through `pdserve-router-internal` (50052), whose
endpoints are every router pod until it is gone (publishNotReadyAddresses), so a new router
gathers its workers before it is ready. A podman network alias shared by both routers would not
do: podman's DNS lists their addresses in a fixed order, so every join and every client would
reach the same router, where kube-proxy spreads connections over both.
"""

from __future__ import annotations

import json
import time
import urllib.request

import grpc
import pytest

from pdserve.protos import pdserve_pb2_grpc, worker_pb2, worker_pb2_grpc
from pdserve.wire import grpc_util, tls
from tests.deploy.containers import PlainK8s, Pod
from tests.faults.load import Load
from tests.serving.test_disaggregated import chat_request, collect

pytestmark = pytest.mark.slow

CLIENTS = 3
MAX_TOKENS = 12  # short streams: a few seconds each on one busy core
REQUEST_TIMEOUT_S = 120.0
PROMPTS = [f"Tell me a short fact about the number {i}." for i in range(3)]
CLEAN_WITHIN_S = 20.0


class Authorized:
    """A Generation stub that sends the API key the overlay's router asks for with every call."""

    def __init__(self, stub: pdserve_pb2_grpc.GenerationStub, key: str):
        self._stub, self._metadata = stub, (("authorization", f"Bearer {key}"),)

    def Generate(self, request, **kwargs):  # noqa: N802 (the stub's name)
        return self._stub.Generate(request, metadata=self._metadata, **kwargs)


def migrations(router: Pod) -> float:
    """The router's ``pdserve:request_migrations_total``."""
    with urllib.request.urlopen(f"http://{router.ip}:8000/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("pdserve:request_migrations_total"):
                return float(line.split()[-1])
    return 0.0


def worker_stats(cluster: PlainK8s, pod: Pod) -> worker_pb2.WorkerStats:
    """Stats over the internal plane's mTLS, as the router asks (with the router's certificate)."""
    router_tls = tls.load(str(cluster.tls / "router.pem"), str(cluster.tls / "router.key"),
                          str(cluster.tls / "ca.pem"), prefix="tls")
    stub = worker_pb2_grpc.PrefillWorkerStub if pod.role == "prefill" else worker_pb2_grpc.DecodeWorkerStub
    with grpc_util.channel(f"{pod.ip}:50061", router_tls) as ch:
        return stub(ch).Stats(worker_pb2.StatsRequest(), timeout=10)


def assert_no_kv_held(cluster: PlainK8s) -> None:
    workers = cluster.running("prefill") + cluster.running("decode")
    deadline = time.monotonic() + CLEAN_WITHIN_S
    while True:
        held = {p.name: (s.num_blocks_used, s.num_held_leases) for p in workers
                if (s := worker_stats(cluster, p)).num_blocks_used or s.num_held_leases}
        if not held:
            return
        assert time.monotonic() < deadline, f"KV still held {CLEAN_WITHIN_S} s after the load: {held}"
        time.sleep(0.5)


def roll(cluster: PlainK8s, role: str) -> dict:
    """One Deployment's rolling restart (one pod: maxSurge 1, maxUnavailable 0); when the old
    pod was deleted, and how long each step took."""
    assert cluster.specs[role]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    [old] = cluster.running(role)
    start = time.monotonic()
    new = cluster.start(role)
    ready_s = cluster.wait_ready(new)
    if role == "router":  # nothing migrated while the old router served
        assert migrations(old) == 0, json.dumps(cluster.logs(), indent=1)
    deleted = time.monotonic()
    stopped = cluster.terminate(old)
    assert stopped.exit_code == 0, f"the old {role} pod did not drain within its grace:\n{cluster.log(old)}"
    return {"role": role, "deleted": deleted, "surge_s": round(ready_s, 1), "stop_s": round(stopped.seconds, 1),
            "total_s": round(time.monotonic() - start, 1)}


def test_rolling_each_deployment_loses_no_request(plain_k8s):
    channel = grpc.insecure_channel(plain_k8s.public.address, options=[
        ("grpc.max_reconnect_backoff_ms", 1000), ("grpc.initial_reconnect_backoff_ms", 200)])
    stub = Authorized(pdserve_pb2_grpc.GenerationStub(channel), plain_k8s.api_key)
    with channel:
        reference = {i: collect(stub.Generate(chat_request(p, MAX_TOKENS, ignore_eos=True), timeout=300))[0]
                     for i, p in enumerate(PROMPTS)}
        timings = []
        with Load(stub, PROMPTS, MAX_TOKENS, CLIENTS, REQUEST_TIMEOUT_S) as load:
            load.wait_for(CLIENTS, timeout_s=REQUEST_TIMEOUT_S)
            for role in ("prefill", "decode", "router"):
                timings.append(roll(plain_k8s, role))
                load.wait_for(CLIENTS, timeout_s=REQUEST_TIMEOUT_S)  # served by the new pod
        print(f"\nrolled under load ({len(load.outcomes)} requests):",
              [{k: v for k, v in t.items() if k != "deleted"} for t in timings])

    errors = [(o.prompt, o.code.name, o.details) for o in load.outcomes if o.code is not None]
    assert not errors, f"{len(errors)} of {len(load.outcomes)} requests failed: {errors[:5]}\n" + json.dumps(
        plain_k8s.logs(), indent=1)
    for o in load.outcomes:
        assert o.tokens == reference[o.prompt], f"prompt {o.prompt}: tokens differ from the undisturbed run"
    assert all(len(tokens) == MAX_TOKENS for tokens in reference.values())
    for t in timings:  # each old pod had streams to finish (or pass on) when it was deleted
        assert load.spanning(t["deleted"]) >= 1, f"no request was running when the old {t['role']} pod was deleted"
    [router] = plain_k8s.running("router")
    assert migrations(router) == 0
    assert_no_kv_held(plain_k8s)
