"""The image, built here (deploy/image.py, what `make image` runs) and run here with podman.

1. `pdserve serve` in one container serves the same greedy tokens as the engine on the host.
2. The plain-Kubernetes overlay's three Deployments, each a container on a podman network of
   their own (tests/deploy/containers.py: args, environment, mounts and secrets as the overlay
   gives them, clients through the router's Service), serve the host engine's greedy tokens
   in float32, with the KV moving from the prefill container to the decode container over NIXL,
   as the overlay sets it. test_image_rollout.py then rolls those same pods.

The image is reused when one was built from the same inputs (deploy/image.py labels it with
their hash), so the build is paid once per change to what the image holds. Where podman is
missing, or this kernel refuses to run a container, the tests skip and say why.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import grpc
import pytest

from pdserve.protos import pdserve_pb2, pdserve_pb2_grpc
from tests.deploy.containers import podman, ulimits

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three facts about the moon:"]
MAX_TOKENS = 16


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

