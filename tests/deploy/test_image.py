"""The image, built here (deploy/image.py, what `make image` runs) and run here with podman.

1. `pdserve serve --dtype float32` in one container serves transformers' greedy tokens.
2. The plain-Kubernetes overlay's three Deployments, each a container on a podman network of
   their own (tests/deploy/containers.py: args, environment, mounts and secrets as the overlay
   gives them, clients through the router's Service), serve the host engine's greedy tokens
   in float32, with the KV moving from the prefill container to the decode container over NIXL,
   as the overlay sets it.
3. Those same pods rolled, one Deployment after the other, as `kubectl rollout restart` does,
   under a steady load: no stream lost or changed, no KV left held.

The image is reused when one was built from the same inputs (deploy/image.py labels it with
their hash), so the build is paid once per change to what the image holds. Where podman is
missing, or this kernel refuses to run a container, the tests skip and say why.
"""

from __future__ import annotations

import json
import shutil
import time
import urllib.request
import uuid
from pathlib import Path

import grpc
import pytest

from pdserve.protos import pdserve_pb2, pdserve_pb2_grpc, worker_pb2, worker_pb2_grpc
from pdserve.wire import grpc_util, tls
from tests.deploy import early_image
from tests.deploy.containers import ROLES, PlainK8s, Pod, load_image_tool, podman, ulimits
from tests.deploy.service import STALL_S
from tests.faults.load import Load
from tests.helpers.chat import chat_request, collect

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three facts about the moon:"]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def image() -> str:
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed: `make .venv/.installed` installs it (with runc and mmdebstrap) "
                    "through apt-get where it runs as root; elsewhere apt-get install podman runc mmdebstrap")
    early_image.wait()  # started with the session (tests/deploy/early_image.py); reused below if it built
    tool = load_image_tool()
    record = tool.build(tool.DEFAULT_TAG, None)
    probe = podman("run", "--rm", *ulimits(), "--entrypoint", "true", record["tag"], check=False)
    if probe.returncode != 0:
        pytest.skip(f"this kernel refuses to run a container: podman run said: {probe.stderr.strip()[-400:]}")
    return record["tag"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The default model as the host serves it, readable by the image's user (uid 10001)."""
    from pdserve.engine.loader import materialize

    out = tmp_path_factory.mktemp("model")
    for item in Path(materialize("default")).iterdir():
        shutil.copy(item, out / item.name)
        (out / item.name).chmod(0o644)
    out.chmod(0o755)
    return out


def host_greedy(model_dir: Path, dtype: str | None) -> list[list[int]]:
    """The engine on the host, same model and dtype (None: the engine's default, as a config
    that names no dtype gets)."""
    from transformers import AutoTokenizer

    from pdserve.engine.sampling.params import SamplingParams
    from tests.factories import make_engine

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    engine = make_engine(model_dir, tokenizer=tokenizer, dtype=dtype)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    done = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return [c.token_ids for c in done]


def served_greedy(address: str, metadata=(), tokenizer_dir: Path | None = None) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    out = []
    with grpc.insecure_channel(address) as channel:
        stub = pdserve_pb2_grpc.GenerationStub(channel)
        for prompt in PROMPTS:
            request = pdserve_pb2.GenerateRequest(
                token_ids=pdserve_pb2.TokenIds(ids=tokenizer(prompt)["input_ids"]),
                sampling=pdserve_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
            out.append([t for r in stub.Generate(request, timeout=300, metadata=metadata) for t in r.token_ids])
    return out


def wait_serving(address: str, container: str, timeout_s: float = 300.0, metadata=()) -> None:
    """Until the router at ``address`` answers ListModels; fails with the container's log if it exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with grpc.insecure_channel(address) as channel:
                pdserve_pb2_grpc.GenerationStub(channel).ListModels(pdserve_pb2.ListModelsRequest(), timeout=2,
                                                                   metadata=metadata)
                return
        except grpc.RpcError:
            pass
        state = podman("inspect", container, "--format", "{{.State.Running}}", check=False).stdout.strip()
        if state != "true":
            raise AssertionError(f"{container} exited:\n{podman('logs', container, check=False).stdout[-4000:]}")
        time.sleep(1.0)
    raise AssertionError(f"{container} did not serve in {timeout_s:.0f} s:\n"
                         f"{podman('logs', container, check=False).stdout[-4000:]}")


def test_serve_in_one_container_gives_transformers_greedy_tokens(image, model_dir, free_ports):
    """``--dtype float32``: each prompt's served greedy tokens are transformers' ``generate``
    on the host, token for token (tests.factories.assert_greedy_matches: a near tie may go
    either way)."""
    http_port, grpc_port = free_ports(2)
    name = f"pdserve-serve-{uuid.uuid4().hex[:8]}"
    podman("run", "-d", "--name", name, "--network", "host", "--shm-size", "1g", *ulimits(),
           "-v", f"{model_dir}:/models/model:ro", image, "serve", "/models/model", "--served-model-name", "smollm2",
           "--dtype", "float32", "--host", "127.0.0.1", "--port", str(http_port), "--grpc-port", str(grpc_port),
           "--kv-cache-gib", "0.25", "--threads-per-worker", "1")
    try:
        wait_serving(f"127.0.0.1:{grpc_port}", name)
        served = served_greedy(f"127.0.0.1:{grpc_port}", tokenizer_dir=model_dir)
    finally:
        podman("stop", "--time", "30", name, check=False, timeout=90)
        log = podman("logs", name, check=False).stdout
        podman("rm", "-f", name, check=False)
    from transformers import AutoTokenizer

    from tests.factories import assert_greedy_matches, default_reference

    # model_dir holds copies of the default model's files: the process's one transformers copy of it
    tokenizer, reference = AutoTokenizer.from_pretrained(str(model_dir)), default_reference()[0]
    for prompt, tokens in zip(PROMPTS, served):
        assert_greedy_matches(reference, tokenizer(prompt)["input_ids"], tokens, MAX_TOKENS,
                              what=f"{prompt!r} served in the container\n{log[-3000:]}")
    assert "pdserve: stopping" in log  # SIGTERM to the container drained and stopped the cluster


@pytest.fixture(scope="module")
def plain_k8s(image, model_dir, tmp_path_factory):
    """The plain-k8s overlay's router, prefill and decode pods, each ready (tests/deploy/containers.py);
    the module's last test rolls them."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl (with kustomize) renders the overlay; it is not installed")
    cluster = PlainK8s(image, model_dir, tmp_path_factory.mktemp("plain-k8s"))
    try:
        pods = [cluster.start(role) for role in ROLES]
        for pod in pods[1:] + pods[:1]:  # the router is ready once both workers have joined it
            cluster.wait_ready(pod)
        yield cluster
    finally:
        cluster.close()


def test_the_plain_k8s_deployments_serve_from_three_containers(plain_k8s, model_dir):
    auth = (("authorization", f"Bearer {plain_k8s.api_key}"),)
    served = served_greedy(plain_k8s.public.address, metadata=auth, tokenizer_dir=model_dir)
    metrics = {role: podman("exec", pod.name, "python", "-c", METRICS_OF_9100, check=False).stdout
               for role in ("prefill", "decode") for pod in plain_k8s.running(role)}
    assert served == host_greedy(model_dir, "float32"), json.dumps(plain_k8s.logs(), indent=1)
    pulled = [line for line in metrics["decode"].splitlines()
              if line.startswith("pdserve:kv_transfer_bytes_total") and not line.endswith(" 0.0")]
    assert pulled, metrics["decode"][-2000:]  # the decode container pulled the KV from the prefill container
    [router] = plain_k8s.running("router")
    log = podman("logs", router.name, check=False)
    assert "autoscaler round failed" not in log.stdout + log.stderr  # the overlay's observe-only controller runs


METRICS_OF_9100 = "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:9100/metrics').read().decode())"

# The rolling restart's load: three clients, short streams (a few seconds each on one busy core).
CLIENTS = 3
ROLL_TOKENS = 12
REQUEST_TIMEOUT_S = 120.0
ROLL_PROMPTS = [f"Tell me a short fact about the number {i}." for i in range(3)]
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
    with grpc_util.channel(f"{pod.ip}:50061", router_tls, peer=pod.role) as ch:
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
    return {"role": role, "start": start, "deleted": deleted, "surge_s": round(ready_s, 1),
            "stop_s": round(stopped.seconds, 1), "total_s": round(time.monotonic() - start, 1)}


def stalls(service, since: float) -> list[tuple[float, float]]:
    """A Service proxy's stalls, as (seconds from ``since`` (wall time), seconds late)."""
    return [(round(wall - since, 1), late) for wall, late in service.stalls]


def test_rolling_each_deployment_loses_no_request(plain_k8s):
    """`kubectl rollout restart` of each plain-k8s Deployment, in containers, under a steady load:
    the prefill pool, then the decode pool, then the router, while clients keep greedy float32
    streams running. Every stream completes with the tokens of an undisturbed run, none fails,
    nothing migrates, and afterwards no worker holds a KV block or lease.

    The pods are ``plain_k8s``'s, run from the image as the overlay declares them
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
    channel = grpc.insecure_channel(plain_k8s.public.address, options=[
        ("grpc.max_reconnect_backoff_ms", 1000), ("grpc.initial_reconnect_backoff_ms", 200)])
    stub = Authorized(pdserve_pb2_grpc.GenerationStub(channel), plain_k8s.api_key)
    with channel:
        reference = {i: collect(stub.Generate(chat_request(p, ROLL_TOKENS, ignore_eos=True), timeout=300))[0]
                     for i, p in enumerate(ROLL_PROMPTS)}
        timings = []
        with Load(stub, ROLL_PROMPTS, ROLL_TOKENS, CLIENTS, REQUEST_TIMEOUT_S) as load:
            load.wait_for(CLIENTS, timeout_s=REQUEST_TIMEOUT_S)
            for role in ("prefill", "decode", "router"):
                timings.append(roll(plain_k8s, role))
                load.wait_for(CLIENTS, timeout_s=REQUEST_TIMEOUT_S)  # served by the new pod
        # A timeline in seconds from the load's start: each roll's start and deletion of the old pod.
        t0 = load.started
        steps = [{**t, "start": round(t["start"] - t0, 1), "deleted": round(t["deleted"] - t0, 1)} for t in timings]
        print(f"\nrolled under load ({len(load.outcomes)} requests):", steps)

    # Reading a failure: gRPC reports any close of a connection that has had its max-age GOAWAY
    # with that GOAWAY's text ("Socket closed (GOAWAY received; ... max_age)"), so the text alone
    # does not say the stream was refused; tokens sent before it say it had started.
    errors = [(o.prompt, o.code.name, o.details, f"{o.started - t0:.1f}-{o.ended - t0:.1f} s", f"{len(o.tokens)} tokens")
              for o in load.outcomes if o.code is not None]
    assert not errors, (f"{len(errors)} of {len(load.outcomes)} requests failed: {errors[:5]}\nrolls: {steps}\n"
                        f"(seconds from the load's start, {time.strftime('%H:%M:%S', time.gmtime(load.started_at))} UTC)\n"
                        f"the Service proxies' stalls over {STALL_S} s: public {stalls(plain_k8s.public, load.started_at)}, "
                        f"internal {stalls(plain_k8s.internal, load.started_at)}\n"
                        + json.dumps(plain_k8s.logs(), indent=1))
    for o in load.outcomes:
        assert o.tokens == reference[o.prompt], f"prompt {o.prompt}: tokens differ from the undisturbed run"
    assert all(len(tokens) == ROLL_TOKENS for tokens in reference.values())
    for t in timings:  # each old pod had streams to finish (or pass on) when it was deleted
        assert load.spanning(t["deleted"]) >= 1, f"no request was running when the old {t['role']} pod was deleted"
    [router] = plain_k8s.running("router")
    assert migrations(router) == 0
    assert_no_kv_held(plain_k8s)
