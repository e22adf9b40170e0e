import shutil
import socket
from contextlib import ExitStack
from pathlib import Path

import pytest


@pytest.fixture
def free_ports():
    """``free_ports(n)``: n distinct loopback ports that were free a moment ago."""

    def pick(n: int) -> list[int]:
        with ExitStack() as stack:
            socks = [stack.enter_context(socket.socket()) for _ in range(n)]
            for s in socks:
                s.bind(("127.0.0.1", 0))
            return [s.getsockname()[1] for s in socks]

    return pick


@pytest.fixture(scope="session")
def image() -> str:
    """The CPU image, built (or reused) by deploy/image.py; skips where podman cannot run it."""
    from tests.deploy.containers import load_image_tool, podman, ulimits

    if shutil.which("podman") is None:
        pytest.skip("podman is not installed: `make .venv/.installed` installs it (with runc and mmdebstrap) "
                    "through apt-get where it runs as root; elsewhere apt-get install podman runc mmdebstrap")
    tool = load_image_tool()
    record = tool.build(tool.DEFAULT_TAG, None)
    probe = podman("run", "--rm", *ulimits(), "--entrypoint", "true", record["tag"], check=False)
    if probe.returncode != 0:
        pytest.skip(f"this kernel refuses to run a container: podman run said: {probe.stderr.strip()[-400:]}")
    return record["tag"]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """The default model as the host serves it, readable by the image's user (uid 10001)."""
    from pdserve.engine.loader import materialize

    out = tmp_path_factory.mktemp("model")
    for item in Path(materialize("default")).iterdir():
        shutil.copy(item, out / item.name)
        (out / item.name).chmod(0o644)
    out.chmod(0o755)
    return out


@pytest.fixture(scope="session")
def plain_k8s(image, model_dir, tmp_path_factory):
    """The plain-k8s overlay's router, prefill and decode pods, each ready (tests/deploy/containers.py);
    shared by the tests that serve from it and the one that rolls it."""
    from tests.deploy.containers import ROLES, PlainK8s

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
