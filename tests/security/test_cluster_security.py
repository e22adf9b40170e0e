"""A real cluster (Ray actors, NIXL, the default model) with both trust boundaries on: an API key
on the public plane and mTLS on the internal one. Only ``Generation``, health and reflection
answer on the public port; every internal server refuses a client without a certificate of the
cluster's CA; an abort reaches only its own tenant's request; and the controller puts back a
routing table that someone else overwrote."""

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.cluster.certs import COMPONENTS, issue, make_ca
from pdserve.cluster.local import PUSH_TIMEOUT_S
from pdserve.protos import (
    admin_pb2,
    admin_pb2_grpc,
    pdserve_pb2,
    pdserve_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from pdserve.router.auth import ApiKeys
from pdserve.router.tenants import Tenant, key_digest
from pdserve.wire import tls
from pdserve.wire.grpc_util import channel
from tests.clusters import cluster_config, running_cluster
from tests.helpers.chat import assert_chat_greedy, chat_request, collect

pytestmark = pytest.mark.slow

KEY, OTHER_KEY = "sk-test-7f3a-tenant-a", "sk-test-9c1e-tenant-b"
AUTH, OTHER_AUTH = (("authorization", f"Bearer {KEY}"),), (("authorization", f"Bearer {OTHER_KEY}"),)
KEYS = ApiKeys(((key_digest(KEY), Tenant("team-a")), (key_digest(OTHER_KEY), Tenant("team-b"))))


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    out = tmp_path_factory.mktemp("certs")
    ca, other = make_ca(out / "ours"), make_ca(out / "other", name="someone else's CA")
    load = lambda issued, authority: tls.load(str(issued.cert), str(issued.key), str(authority.cert), prefix="tls")
    ours = {name: load(issue(ca, out / "ours", name), ca) for name in COMPONENTS}  # each role its own identity
    return {**ours, "roles": tuple(ours.items()), "stranger": load(issue(other, out / "other", "router"), ca)}


@pytest.fixture(scope="module")
def cluster(certs):
    with running_cluster(cluster_config(api_keys=KEYS, role_tls=certs["roles"], supervise_interval_s=0.5)) as c:
        yield c


@pytest.fixture(scope="module")
def stub(cluster):
    with grpc.insecure_channel(cluster.address) as ch:
        yield pdserve_pb2_grpc.GenerationStub(ch)


def code_of(call) -> grpc.StatusCode:
    try:
        call()
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()


def test_greedy_over_mtls_with_the_key_equals_transformers(stub, reference):
    for q in ("What is the capital of France?", "Name three prime numbers."):
        ids, _, _ = collect(stub.Generate(chat_request(q, 24), metadata=AUTH, timeout=120))
        assert_chat_greedy(reference, q, ids, 24)


def test_grpc_without_the_key_is_unauthenticated(stub):
    generate = lambda metadata: list(stub.Generate(chat_request("Hi", 4), metadata=metadata, timeout=30))
    assert code_of(lambda: generate(())) == grpc.StatusCode.UNAUTHENTICATED
    assert code_of(lambda: generate((("authorization", "Bearer wrong"),))) == grpc.StatusCode.UNAUTHENTICATED
    assert code_of(lambda: generate((("authorization", KEY),))) == grpc.StatusCode.UNAUTHENTICATED  # no scheme
    assert code_of(lambda: generate(AUTH)) == grpc.StatusCode.OK


def test_public_port_serves_no_internal_rpc(cluster):
    """Even with the key: RouterAdmin and every worker RPC do not exist on the public port."""
    with grpc.insecure_channel(cluster.address) as ch:
        admin = admin_pb2_grpc.RouterAdminStub(ch)
        prefill, decode = worker_pb2_grpc.PrefillWorkerStub(ch), worker_pb2_grpc.DecodeWorkerStub(ch)
        calls = [lambda: admin.SetMembership(admin_pb2.Membership(), metadata=AUTH, timeout=5),
                 lambda: admin.GetMembership(admin_pb2.Membership(), metadata=AUTH, timeout=5),
                 lambda: admin.GetLatency(admin_pb2.LatencyRequest(), metadata=AUTH, timeout=5),
                 lambda: prefill.Prefill(worker_pb2.PrefillRequest(), metadata=AUTH, timeout=5),
                 lambda: prefill.Release(worker_pb2.ReleaseRequest(), metadata=AUTH, timeout=5),
                 lambda: prefill.GetAgentMetadata(worker_pb2.AgentMetadataRequest(), metadata=AUTH, timeout=5),
                 lambda: prefill.Abort(worker_pb2.WorkerAbortRequest(), metadata=AUTH, timeout=5),
                 lambda: prefill.Drain(worker_pb2.DrainRequest(), metadata=AUTH, timeout=5),
                 lambda: prefill.Stats(worker_pb2.StatsRequest(), metadata=AUTH, timeout=5),
                 lambda: list(decode.Decode(worker_pb2.DecodeRequest(), metadata=AUTH, timeout=5)),
                 lambda: decode.Abort(worker_pb2.WorkerAbortRequest(), metadata=AUTH, timeout=5)]
        assert [code_of(c) for c in calls] == [grpc.StatusCode.UNIMPLEMENTED] * len(calls)
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)  # no key needed
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def http(cluster, path: str, key: str | None = None, body: dict | None = None) -> int:
    req = urllib.request.Request(f"http://{cluster.http_address}{path}",
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_http_needs_the_key_except_health_and_metrics(cluster):
    body = {"model": "smollm2", "prompt": "Hello", "max_tokens": 2}
    assert http(cluster, "/v1/completions", body=body) == 401
    assert http(cluster, "/v1/completions", "wrong", body) == 401
    assert http(cluster, "/v1/models") == 401
    assert http(cluster, "/v1/completions", KEY, body) == 200
    assert http(cluster, "/health") == 200 and http(cluster, "/metrics") == 200


def test_openai_client_with_api_key(cluster):
    base = f"http://{cluster.http_address}/v1"
    client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0)
    out = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}],
                                         max_tokens=12, temperature=0)
    assert "Paris" in out.choices[0].message.content
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()


def test_internal_servers_refuse_clients_without_a_cluster_certificate(cluster, certs):
    ours, stranger = certs["controller"], certs["stranger"]
    no_cert = grpc.ssl_channel_credentials(ours.ca_pem)  # TLS that trusts the server but shows no certificate
    targets = [(a, worker_pb2_grpc.PrefillWorkerStub) for a in cluster.prefill_addresses] \
        + [(a, worker_pb2_grpc.DecodeWorkerStub) for a in cluster.decode_addresses]
    for address, stub_cls in targets:
        peer = "prefill" if stub_cls is worker_pb2_grpc.PrefillWorkerStub else "decode"
        assert address.startswith("127.0.0.1:")  # a Ray pdserve starts keeps the internal plane on loopback
        stats = lambda ch: stub_cls(ch).Stats(worker_pb2.StatsRequest(), timeout=5)
        with channel(address, None) as plain:
            assert code_of(lambda: stats(plain)) == grpc.StatusCode.UNAVAILABLE
        with grpc.secure_channel(address, no_cert, options=ours.channel_options(peer)) as bare:
            assert code_of(lambda: stats(bare)) == grpc.StatusCode.UNAVAILABLE
        with channel(address, stranger, peer=peer) as foreign:
            assert code_of(lambda: stats(foreign)) == grpc.StatusCode.UNAVAILABLE
        with channel(address, ours, peer=peer) as good:
            assert stats(good).worker_id
    for address in cluster.prefill_addresses:  # NIXL's key to one-sided reads of the whole cache
        meta = lambda ch: worker_pb2_grpc.PrefillWorkerStub(ch).GetAgentMetadata(worker_pb2.AgentMetadataRequest(),
                                                                                timeout=5)
        with grpc.secure_channel(address, no_cert, options=ours.channel_options("prefill")) as bare:
            assert code_of(lambda: meta(bare)) == grpc.StatusCode.UNAVAILABLE
        with channel(address, stranger, peer="prefill") as foreign:
            assert code_of(lambda: meta(foreign)) == grpc.StatusCode.UNAVAILABLE
        with channel(address, certs["decode"], peer="prefill") as good:  # only decode workers may ask
            assert meta(good).backend_metadata
        with channel(address, ours, peer="prefill") as controller:
            assert code_of(lambda: meta(controller)) == grpc.StatusCode.PERMISSION_DENIED
    with channel(cluster.admin_address, stranger, peer="router") as foreign:
        get = lambda: admin_pb2_grpc.RouterAdminStub(foreign).GetMembership(admin_pb2.Membership(), timeout=5)
        assert code_of(get) == grpc.StatusCode.UNAVAILABLE


def test_an_abort_naming_another_tenants_request_has_no_effect(cluster, certs, stub):
    """Clients choose request ids. Another tenant naming this one's id (over the same
    connection, as behind a proxy) is not found, nor is a worker Abort naming the id's first
    attempt, even from a holder of a cluster certificate: the stream completes. The owner's own
    Abort works, from another connection too."""
    request = chat_request("Write a long story about a dragon.", 32, ignore_eos=True)
    request.request_id = "shared-id"
    stream = stub.Generate(request, metadata=AUTH, timeout=120)
    ids = list(next(stream).token_ids)  # running now, with 31 tokens to go
    foreign = stub.Abort(pdserve_pb2.AbortRequest(request_id="shared-id"), metadata=OTHER_AUTH, timeout=5)
    with channel(cluster.decode_addresses[0], certs["router"], peer="decode") as ch:  # the one role that may Abort
        worker = worker_pb2_grpc.DecodeWorkerStub(ch).Abort(worker_pb2.WorkerAbortRequest(request_id="shared-id#0"),
                                                            timeout=5)
    rest, _, resps = collect(stream)
    assert not foreign.found and not worker.found  # old code: both found, and the stream ended ABORT
    assert len(ids + rest) == 32 and resps[-1].finish_reason == pdserve_pb2.FINISH_REASON_LENGTH

    stream = stub.Generate(request, metadata=AUTH, timeout=120)  # the same id, free again
    next(stream)
    separate = [("grpc.use_local_subchannel_pool", 1)]  # its own connection, as another process has
    with grpc.insecure_channel(cluster.address, options=separate) as ch:
        own = pdserve_pb2_grpc.GenerationStub(ch).Abort(pdserve_pb2.AbortRequest(request_id="shared-id"),
                                                        metadata=AUTH, timeout=5)
    assert own.found
    assert collect(stream)[2][-1].finish_reason == pdserve_pb2.FINISH_REASON_ABORT


def test_controller_puts_back_a_membership_someone_overwrote(cluster, certs, stub):
    """An empty SetMembership, even from a holder of a valid certificate, lasts until the
    controller's next round that reaches the router. The window covers one push that fails at
    its own deadline (``LocalCluster.push_membership``, ``PUSH_TIMEOUT_S``) and the round after
    it: once, in a whole suite on the AVX2 EPYC (2026-11-30), a push on a fresh mTLS channel got
    DEADLINE_EXCEEDED while this test's GetMembership calls on an open channel were answered
    (cause not found), and the next round came after a 10 s window had ended."""
    with channel(cluster.admin_address, certs["controller"], peer="router") as ch:
        admin = admin_pb2_grpc.RouterAdminStub(ch)
        admin.SetMembership(admin_pb2.Membership(), timeout=5)
        deadline = time.monotonic() + PUSH_TIMEOUT_S + 10
        members = []
        while time.monotonic() < deadline and len(members) < 2:
            time.sleep(0.2)
            members = admin.GetMembership(admin_pb2.Membership(), timeout=5).members
    assert sorted(m.address for m in members) == sorted(cluster.prefill_addresses + cluster.decode_addresses)
    deadline = time.monotonic() + 10
    while code_of(lambda: collect(stub.Generate(chat_request("Hi", 4), metadata=AUTH, timeout=60))) \
            != grpc.StatusCode.OK:
        assert time.monotonic() < deadline, "the router did not serve again after the membership came back"
        time.sleep(0.5)


def test_ray_refuses_a_driver_without_the_token(cluster):
    """A Ray pdserve starts runs with token authentication: a driver with another token cannot
    join (it could otherwise run any code in the workers). The cluster runs in the tests' shared
    Ray, which ``pdserve.cluster.ray_start.start_local_ray`` started with token auth on, as it
    starts a cluster's own; that a cluster asks it for token auth unless its config says not:
    tests/cluster/test_ray_start.py."""
    gcs = ray.get_runtime_context().gcs_address
    # A refused driver asks the GCS again once a second, 20 times by default; 5 tries make the
    # same refusal (each logs InvalidAuthToken) and give up in ~5 s, not 20.
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64, "RAY_gcs_server_port_wait_time_s": "5"}
    try:
        out = subprocess.run([sys.executable, "-c", f"import ray; ray.init(address={gcs!r}); print('joined')"],
                             env=env, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as exc:  # Ray retries a refused token until it gives up
        out = subprocess.CompletedProcess(exc.cmd, 1, exc.stdout or b"", exc.stderr or b"")
    text = (out.stdout.decode() if isinstance(out.stdout, bytes) else out.stdout) + \
        (out.stderr.decode() if isinstance(out.stderr, bytes) else out.stderr)
    assert "joined" not in text and "InvalidAuthToken" in text
