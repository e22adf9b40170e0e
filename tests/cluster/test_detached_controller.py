"""``pdserve serve --address``: the controller is a detached, named Ray actor, so neither the
``pdserve serve`` process nor the controller's own process takes the cluster down with it.

On a Ray head started with ``ray start`` (token auth, as every test Ray), the real commands
run as a user runs them, with the default model in float32:

1. ``pdserve serve --address`` starts the cluster; greedy output equals transformers.
2. That process is SIGKILLed: the same router and workers keep serving the same tokens.
3. The controller's process is SIGKILLed: Ray starts it again, it takes the running router
   and workers over (same pids: no model load), and its supervisor still works: a decode
   worker SIGKILLed afterwards is replaced, and the stream is served again.
   ``pdserve rollout --pool router`` then replaces the router on the same address.
4. ``pdserve serve --address`` run again attaches to the running cluster (same endpoints);
   Ctrl-C on it drains and stops the cluster: no named actor and no placement group is left.
"""

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import ray
from ray.util.placement_group import placement_group_table

from pdserve.protos import pdserve_pb2_grpc
from tests.clusters import leave_shared_ray
from tests.helpers.chat import assert_chat_greedy, chat_request, collect
from tests.helpers.ray_nodes import ENV, RAY, free_port

pytestmark = pytest.mark.slow

PDSERVE = str(Path(sys.executable).parent / "pdserve")
QUESTION = "What is the capital of France?"
BANNER = re.compile(r"pdserve: (started|attached to the running cluster): OpenAI HTTP API on http://[\d.:]+/v1, "
                    r"gRPC API listening on ([\d.]+:\d+)")


@pytest.fixture
def ray_head():
    port = free_port()
    try:
        subprocess.run([RAY, "start", "--head", f"--port={port}", "--include-dashboard=false", "--num-cpus=4",
                        "--disable-usage-stats"], env=ENV, check=True, capture_output=True)
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([RAY, "stop", "--force"], env=ENV, capture_output=True)


def serve(address: str, log: Path) -> tuple[subprocess.Popen, str, str]:
    """Run ``pdserve serve --address`` until it prints its banner: (process, started or
    attached, the router's gRPC address)."""
    out = open(log, "w+")
    proc = subprocess.Popen([PDSERVE, "serve", "--address", address, "--internal-host", "127.0.0.1",
                             "--grpc-port", "0", "--port", "0", "--kv-cache-gib", "0.2", "--dtype", "float32"],
                            stdout=out, stderr=subprocess.STDOUT, env=ENV, start_new_session=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        found = BANNER.search(log.read_text())
        if found:
            return proc, found.group(1), found.group(2)
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(log.read_text()[-3000:])


def status_command(address: str) -> dict | None:
    """``pdserve status --json``, as a user runs it; None when no cluster runs."""
    done = subprocess.run([PDSERVE, "status", "--address", address, "--json"], env=ENV, capture_output=True,
                          text=True, timeout=120)
    if done.returncode == 1 and "no cluster named" in done.stderr:
        return None
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def status() -> dict:
    """The controller's ``status``, asked from this process (a driver of the cluster's
    namespace: each ``pdserve status`` process would spend seconds joining Ray)."""
    from pdserve.cluster import controller

    return ray.get(controller.find().status.remote(), timeout=120)


def wait_status(ok, what: str, timeout_s: float = 180) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            now = status()
        except (AttributeError, ray.exceptions.RayActorError) as exc:  # no controller, or it is restarting
            now = exc
        if isinstance(now, dict) and ok(now):
            return now
        assert time.monotonic() < deadline, f"{what}: {now}"
        time.sleep(0.2)  # each poll is one actor call: the step waited on ends sooner than a 1 s poll sees


def pids(s: dict) -> dict:
    return {"router": s["router_pid"], "prefill": [w["pid"] for w in s["prefill"]],
            "decode": [w["pid"] for w in s["decode"]]}


def greedy(grpc_address: str, reference) -> None:
    """One chat request, served in full and equal to transformers' greedy answer."""
    with grpc.insecure_channel(grpc_address) as ch:
        ids, text, _ = collect(pdserve_pb2_grpc.GenerationStub(ch).Generate(chat_request(QUESTION, 12), timeout=120))
    assert "Paris" in text
    assert_chat_greedy(reference, QUESTION, ids, 12)


def test_the_cluster_outlives_its_driver_and_its_controller(ray_head, reference, tmp_path):
    driver, how, grpc_address = serve(ray_head, tmp_path / "serve1.log")
    leave_shared_ray()  # this driver joins the head instead
    ray.init(address=ray_head, namespace="pdserve", logging_level=logging.WARNING)
    try:
        assert how == "started"
        greedy(grpc_address, reference)
        first = status_command(ray_head)
        assert first["grpc_address"] == grpc_address and not first["adopted"]
        assert len(first["prefill"]) == 1 and len(first["decode"]) == 1 and None not in pids(first)["decode"]

        # 2. The driver dies without a word: nothing it started goes with it.
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(30)
        greedy(grpc_address, reference)
        assert pids(status()) == pids(first)

        # 3. The controller dies: Ray starts it again and it takes the same processes over.
        os.kill(first["controller_pid"], signal.SIGKILL)
        second = wait_status(lambda s: s["controller_pid"] != first["controller_pid"], "Ray restarted the controller")
        assert second["adopted"] and pids(second) == pids(first), (first, second)
        assert second["grpc_address"] == grpc_address
        greedy(grpc_address, reference)
        # ... and supervises them: a dead decode worker is replaced, and serves.
        os.kill(first["decode"][0]["pid"], signal.SIGKILL)
        third = wait_status(lambda s: None not in pids(s)["decode"] and pids(s)["decode"] != pids(first)["decode"],
                            "the decode worker was replaced")
        assert third["router_pid"] == first["router_pid"] and pids(third)["prefill"] == pids(first)["prefill"]
        deadline = time.monotonic() + 60
        while True:  # the replacement joins the router's table on the supervisor's next round
            try:
                greedy(grpc_address, reference)
                break
            except grpc.RpcError as exc:
                assert time.monotonic() < deadline, exc
                time.sleep(0.2)

        # ... and `pdserve rollout` replaces the router: same address, a new process, and the
        # old one's named actor is gone (step 4 finds no actor left).
        done = subprocess.run([PDSERVE, "rollout", "--address", ray_head, "--pool", "router"], env=ENV,
                              capture_output=True, text=True, timeout=180)
        assert done.returncode == 0 and "router: " in done.stdout, done.stderr[-2000:]
        rolled = status()
        assert rolled["grpc_address"] == grpc_address and rolled["router_pid"] != third["router_pid"]
        greedy(grpc_address, reference)

        # 4. serve again attaches; its Ctrl-C stops the cluster and leaves nothing behind.
        driver, how, again = serve(ray_head, tmp_path / "serve2.log")
        assert how == "attached to the running cluster" and again == grpc_address
        assert pids(status()) == pids(rolled)
        os.killpg(driver.pid, signal.SIGINT)
        assert driver.wait(120) == 0, (tmp_path / "serve2.log").read_text()[-2000:]
        assert status_command(ray_head) is None
        groups = [g["name"] for g in placement_group_table().values() if g["state"] != "REMOVED"]
        assert ray.util.list_named_actors() == [] and groups == []
    finally:
        if driver.poll() is None:
            driver.kill()
        # Disconnect before the fixture's `ray stop`, or this process exits with the Ray it joined.
        ray.shutdown()
