"""Ray's own autoscaler adds the node that a pool's pending worker asks for, on this machine.

``ray.cluster_utils.AutoscalingCluster`` runs Ray's real autoscaler with its fake multi-node
provider: each node it launches is a raylet of its own on this machine. There are two node
types, one per pool, each offering one worker's CPU and one unit of its pool's custom resource
(``pdserve_prefill`` / ``pdserve_decode``), one of each from the start and at most two; the head
offers neither. pdserve joins that Ray as ``pdserve serve --config ... --address ...`` does.
A load of long prompts makes pdserve's controller grow the prefill pool; the new worker's
placement group stays pending until Ray adds a node offering ``pdserve_prefill`` (never a
decode node); every request completes with transformers' greedy tokens; when the load stops,
the controller drains the extra worker and Ray removes the node once it is idle.

``AutoscalingCluster`` starts and stops with ``ray stop --force``, which stops every Ray on the
machine: run it alone (under /work/wt/heavy.lock here).
"""

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import time

import grpc
import pytest
import ray
import yaml
from ray.cluster_utils import AutoscalingCluster

from pdserve.cluster.local import LocalCluster
from pdserve.cluster.serve_config import build
from pdserve.cluster.settings import add_arguments, resolve
from pdserve.engine.loader import materialize
from pdserve.protos import pdserve_pb2, pdserve_pb2_grpc
from tests.factories import hf_greedy, random_prompts

pytestmark = pytest.mark.slow

MB = 1 << 20
MAX_TOKENS = 4
PROMPTS = random_prompts(4, [1024], seed=7)  # long prompts; the tiny model's vocab is 512
IN_FLIGHT = 4  # requests kept open at once: ~3k prompt tokens queued on one prefill worker, 10x the target


def node_type(resource: str) -> dict:
    # One worker's CPU and one unit of the pool's resource per node. One of each type from the
    # start (as a KubeRay group's minReplicas), up to two: a decode node could be added as well.
    return {"resources": {"CPU": 1, resource: 1, "object_store_memory": 80 * MB},
            "node_config": {}, "min_workers": 1, "max_workers": 2}


class FakeAutoscalingCluster(AutoscalingCluster):
    """``AutoscalingCluster`` builds its config on the provider's ``example.yaml``, which the
    Ray 2.60 wheel does not ship: the same template is given here, with a 3 s idle timeout."""

    def _generate_config(self, head_resources, worker_node_types, autoscaler_v2=False, **config_kwargs):
        return {
            "cluster_name": "pdserve-fake", "max_workers": 4, "head_node_type": "ray.head.default",
            "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                         "disable_launch_config_check": True},
            "available_node_types": {**worker_node_types, "ray.head.default": {
                "resources": head_resources, "node_config": {}, "max_workers": 0}},
            "upscaling_speed": 1.0, "idle_timeout_minutes": 0.05, "auth": {}, "docker": {}, "file_mounts": {},
            "cluster_synced_files": [], "file_mounts_sync_continuously": False, "rsync_exclude": [],
            "rsync_filter": [], "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
            "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": [],
        }

    def shutdown(self):
        """``ray stop --force`` as the base class runs it, with a grace of 3 s instead of 16: with
        --force every Ray process is sent SIGKILL at once, and the grace is only how long ``ray
        stop`` then waits to see them gone (a third of it per kind of process; whatever is still
        there is sent SIGKILL again)."""
        subprocess.check_call(["ray", "stop", "--force", "--grace-period", "3"])
        ray._private.services.find_gcs_addresses.cache_clear()


@pytest.fixture
def fake_ray(monkeypatch, tmp_path_factory):
    """A head with one CPU and no pool resource; ``ray start`` is the venv's: a folder holding
    only that ``ray`` goes first on PATH. Not the venv's whole bin folder: its ``ninja`` (pip's,
    a newer one than the system's that every other test builds the CPU kernels with) hashes the
    build log's commands another way, so each worker on these nodes would compile the kernels
    again (about 20 s of both cores), and the next test's workers once more. (Where PATH has
    no other ``ninja``, the venv's goes in the folder too, as before.)"""
    bin_dir = tmp_path_factory.mktemp("ray-bin")
    for tool in ("ray",) if shutil.which("ninja") else ("ray", "ninja"):
        (bin_dir / tool).symlink_to(os.path.join(os.path.dirname(sys.executable), tool))
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    cluster = FakeAutoscalingCluster(
        head_resources={"CPU": 1, "object_store_memory": 80 * MB},
        worker_node_types={"prefill": node_type("pdserve_prefill"), "decode": node_type("pdserve_decode")})
    ray.shutdown()  # a driver still joined to an earlier Ray would skip joining this one
    try:
        cluster.start()  # `ray stop --force` first: every Ray on this machine stops
        yield f"{ray.util.get_node_ip_address()}:6379"
    finally:
        ray.shutdown()  # this process is a driver of that Ray: leave it before it stops
        cluster.shutdown()


def serve_config(tmp_path, model_dir, address: str):
    """The config ``pdserve serve --config pdserve.yaml --address ADDRESS`` runs with."""
    settings = {
        "model": str(model_dir), "tokenizer": str(materialize("default", progress=False)), "dtype": "float32",
        "kv_cache_gib": 0.0625, "enable_prefix_caching": False, "max_num_batched_tokens": 64,
        "threads_per_worker": 1, "cpus_per_worker": 1, "grpc_port": 0, "port": -1,
        "internal_host": "127.0.0.1",  # every node is this machine
        "prefill_resource": "pdserve_prefill", "decode_resource": "pdserve_decode",
        "autoscaling": {pool: {"target": target, "slo_s": 600, "max_replicas": 2, "window_s": 2,
                               "scale_up_cooldown_s": 1, "scale_down_cooldown_s": 2}
                        for pool, target in (("prefill", 256), ("decode", 0.9))},
    }
    path = tmp_path / "pdserve.yaml"
    path.write_text(yaml.safe_dump(settings))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return build(resolve(parser.parse_args(["--config", str(path), "--address", address]), environ={}))


def nodes_offering(resource: str) -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"]}


async def long_prompt_load(address: str, done) -> list[tuple[int, list[int]]]:
    """Keep ``IN_FLIGHT`` long prompts open until ``done(completed)``; returns (prompt, tokens)."""
    results = []

    async def one(i: int) -> None:
        req = pdserve_pb2.GenerateRequest(token_ids=pdserve_pb2.TokenIds(ids=PROMPTS[i % len(PROMPTS)]),
                                          sampling=pdserve_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        tokens = [t async for r in stub.Generate(req, timeout=120) for t in r.token_ids]
        results.append((i % len(PROMPTS), tokens))

    async with grpc.aio.insecure_channel(address) as ch:
        stub = pdserve_pb2_grpc.GenerationStub(ch)
        running, sent = set(), 0
        while not done(len(results)):
            while len(running) < IN_FLIGHT:
                running.add(asyncio.create_task(one(sent)))
                sent += 1
            finished, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in finished:
                task.result()  # a failed request fails the test here
        await asyncio.gather(*running)
    return results


def wait_for(condition, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout_s:.0f} s; nodes: {ray.nodes()}"
        time.sleep(0.5)


def test_a_long_prompt_load_makes_ray_add_a_prefill_node_and_remove_it_after(fake_ray, tmp_path, tiny_llama_dir):
    model_dir, hf_model = tiny_llama_dir
    cluster = LocalCluster(serve_config(tmp_path, model_dir, fake_ray))
    try:
        cluster.start()  # returns once Ray has added a node per pool for the first workers
        first_prefill, decode = nodes_offering("pdserve_prefill"), nodes_offering("pdserve_decode")
        assert len(first_prefill) == 1 and len(decode) == 1

        grown_at = []  # requests completed when the new worker joined the routing table
        deadline = time.monotonic() + 120

        def grown_and_used(completed: int) -> bool:  # and twice IN_FLIGHT more went by since
            assert time.monotonic() < deadline, f"no second prefill worker within 120 s; nodes: {ray.nodes()}"
            if not grown_at and len(cluster.addresses("prefill")) == 2:
                grown_at.append(completed)
            return bool(grown_at) and completed - grown_at[0] >= 2 * IN_FLIGHT

        results = asyncio.run(long_prompt_load(cluster.address, grown_and_used))
        added = {ray.get(a.node_id.remote()) for a in cluster.actors("prefill")} - first_prefill
        assert len(added) == 1 and added <= nodes_offering("pdserve_prefill")
        assert nodes_offering("pdserve_decode") == decode  # no decode node was added
        expected = [hf_greedy(hf_model, p, MAX_TOKENS) for p in PROMPTS]
        assert all(tokens == expected[i] for i, tokens in results), "a served completion is not transformers' greedy"

        wait_for(lambda: len(cluster.addresses("prefill")) == 1, "the controller drained the extra prefill worker")
        wait_for(lambda: not added & nodes_offering("pdserve_prefill"), "Ray removed the idle prefill node")
        assert nodes_offering("pdserve_prefill") == first_prefill and nodes_offering("pdserve_decode") == decode
        traces = cluster.autoscaler.traces
        assert [[d.action for d in traces[pool].decisions if d.action != "hold"] for pool in ("prefill", "decode")] \
            == [["up", "down"], []]
    finally:
        cluster.stop()
