"""The image, built here (deploy/image.py, what `make image` runs) and run here with podman.

1. `pdserve serve` in one container serves the same greedy tokens as the engine on the host.
2. The plain-Kubernetes overlay's three Deployments, each in its own container on a podman
   network of their own (one address per container, as pods have): the args, environment
   variables and mounts come from `kubectl kustomize deploy/k8s/overlays/plain-k8s`, the config
   is the overlay's own pdserve.yaml, and the TLS and API-key secrets are made here. The KV
   moves from the prefill container to the decode container over NIXL, as the overlay sets it.

The image is reused when one was built from the same inputs (deploy/image.py labels it with
their hash), so the build is paid once per change to what the image holds. Where podman is
missing, or this kernel refuses to run a container, the tests skip and say why.
"""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import shutil
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import grpc
import pytest
import yaml

from pdserve.protos import pdserve_pb2, pdserve_pb2_grpc

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
OVERLAY = ROOT / "deploy" / "k8s" / "overlays" / "plain-k8s"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three facts about the moon:"]
MAX_TOKENS = 16


def load_image_tool():
    spec = importlib.util.spec_from_file_location("pdserve_image_tool", ROOT / "deploy" / "image.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ulimits() -> list[str]:
    """The container's limits, at or below this process's (runc may not raise them)."""
    nofile = min(resource.getrlimit(resource.RLIMIT_NOFILE)[0], 16384)
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    nproc = 8192 if nproc == resource.RLIM_INFINITY else min(nproc, 8192)
    return ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={nproc}:{nproc}"]


def podman(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", "--runtime", "runc", *args], capture_output=True, text=True, check=check,
                          timeout=timeout)


@pytest.fixture(scope="module")
def image() -> str:
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed: `make .venv/.installed` installs it (with runc and mmdebstrap) "
                    "through apt-get where it runs as root; elsewhere apt-get install podman runc mmdebstrap")
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

    from pdserve.engine.sampling import SamplingParams
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


def test_serve_in_one_container_gives_the_hosts_greedy_tokens(image, model_dir, free_ports):
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
    assert served == host_greedy(model_dir, "float32"), log[-3000:]
    assert "pdserve: stopping" in log  # SIGTERM to the container drained and stopped the cluster


def plain_k8s_deployments() -> dict[str, dict]:
    rendered = subprocess.run(["kubectl", "kustomize", str(OVERLAY)], capture_output=True, text=True, check=True)
    docs = [d for d in yaml.safe_load_all(rendered.stdout) if d and d.get("kind") == "Deployment"]
    return {d["metadata"]["name"].removeprefix("pdserve-"): d["spec"]["template"]["spec"] for d in docs}


def secrets(tmp: Path) -> tuple[Path, Path, str]:
    """The overlay's two secrets as Kubernetes mounts them: files readable by the pod's user."""
    tls = tmp / "tls"
    subprocess.run([sys.executable, "-m", "pdserve.cluster.certs", str(tls)], check=True, capture_output=True)
    (tls / "ca.key").unlink()  # the deploy guide keeps it off the cluster
    api_key_dir = tmp / "api-key"
    api_key_dir.mkdir()
    key = uuid.uuid4().hex
    (api_key_dir / "api-key").write_text(key)
    for path in [*tls.iterdir(), api_key_dir / "api-key"]:
        path.chmod(stat.S_IRUSR | stat.S_IWUSR | stat.S_IRGRP | stat.S_IROTH)  # a Secret's defaultMode 0644
    return tls, api_key_dir, key


def test_the_plain_k8s_deployments_serve_from_three_containers(image, model_dir, tmp_path):
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl (with kustomize) renders the overlay; it is not installed")
    specs = plain_k8s_deployments()
    tls, api_key_dir, key = secrets(tmp_path)
    subnet = 200 + os.getpid() % 50
    network = f"pdserve-test-{uuid.uuid4().hex[:8]}"
    podman("network", "create", "--subnet", f"10.123.{subnet}.0/24", network)
    addresses = {"router": f"10.123.{subnet}.10", "prefill": f"10.123.{subnet}.11", "decode": f"10.123.{subnet}.12"}
    names = {role: f"{network}-{role}" for role in addresses}
    mounts = {"model": f"{model_dir}:/models/model:ro", "config": f"{OVERLAY}:/etc/pdserve/config:ro",
              "tls": f"{tls}:/etc/pdserve/tls:ro", "api-key": f"{api_key_dir}:/etc/pdserve/api-key:ro"}
    try:
        for role in ("router", "prefill", "decode"):
            spec = specs[role]
            container = spec["containers"][0]
            env = {}
            for item in container.get("env", []):
                field = item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
                env[item["name"]] = {"metadata.name": names[role], "status.podIP": addresses[role]}.get(
                    field, item.get("value"))
            # What this machine cannot give a pod: the overlay's 20 GiB of KV and its cores.
            env |= {"PDSERVE_KV_CACHE_GIB": "0.25", "PDSERVE_THREADS_PER_WORKER": "1"}
            volumes = [arg for m in container.get("volumeMounts", []) if m["name"] in mounts
                       for arg in ("-v", mounts[m["name"]])]
            alias = ["--network-alias", "pdserve-router-internal"] if role == "router" else []
            podman("run", "-d", "--name", names[role], "--network", network, "--ip", addresses[role], *alias,
                   "--shm-size", "1g", *ulimits(), *volumes, *[a for k, v in env.items() for a in ("-e", f"{k}={v}")],
                   image, *container["args"])
        router = f"{addresses['router']}:50051"
        auth = (("authorization", f"Bearer {key}"),)
        wait_serving(router, names["router"], metadata=auth)
        deadline = time.monotonic() + 300
        while True:  # the workers join through the router's membership API
            try:
                served = served_greedy(router, metadata=auth, tokenizer_dir=model_dir)
                break
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
                time.sleep(2.0)
        metrics = {role: podman("exec", names[role], "python", "-c", METRICS_OF_9100, check=False).stdout
                   for role in ("prefill", "decode")}
    finally:
        logs = {role: podman("logs", name, check=False).stdout[-3000:] for role, name in names.items()}
        for name in names.values():
            podman("rm", "-f", "--time", "5", name, check=False, timeout=90)
        podman("network", "rm", "-f", network, check=False)
    # The overlay's config names no dtype: the host engine takes the same default.
    assert served == host_greedy(model_dir, None), json.dumps(logs, indent=1)
    pulled = [line for line in metrics["decode"].splitlines()
              if line.startswith("pdserve:kv_transfer_bytes_total") and not line.endswith(" 0.0")]
    assert pulled, metrics["decode"][-2000:]  # the decode container pulled the KV from the prefill container


METRICS_OF_9100 = "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:9100/metrics').read().decode())"

