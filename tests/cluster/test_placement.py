"""Two Ray nodes on this machine (``ray start``, each with a custom resource): prefill workers
land on the node offering the prefill resource, decode workers on the other, and a request
still flows from one to the other over NIXL."""

import subprocess

import grpc
import pytest
import ray

from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.local import LocalCluster
from pdserve.cluster.placement import PoolPlacement
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.protos import pdserve_pb2, pdserve_pb2_grpc
from tests.clusters import leave_shared_ray
from tests.helpers.ray_nodes import ENV, RAY, free_port

pytestmark = pytest.mark.slow


@pytest.fixture
def two_nodes():
    leave_shared_ray()  # a driver still in the tests' shared Ray would place the cluster there
    port = free_port()
    # Each worker reserves the CPUs it runs threads on (one here): the prefill node holds two.
    common = ["--num-cpus=2", "--disable-usage-stats"]
    try:
        subprocess.run([RAY, "start", "--head", f"--port={port}", "--include-dashboard=false",
                        '--resources={"prefill_nodes": 8}', *common], env=ENV, check=True, capture_output=True)
        subprocess.run([RAY, "start", f"--address=127.0.0.1:{port}", '--resources={"decode_nodes": 8}', *common],
                       env=ENV, check=True, capture_output=True)
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([RAY, "stop", "--force"], env=ENV, capture_output=True)


def test_each_pool_lands_on_its_own_node(two_nodes):
    config = ClusterConfig(
        engine=EngineConfig(cache=CacheConfig(memory_budget_bytes=64 << 20)), num_prefill=2, num_decode=1,
        grpc_port=0, http_port=None, ray_address=two_nodes, threads_per_worker=1,
        internal_host="127.0.0.1",  # both nodes are this machine; Ray registers them at its outward IP
        prefill_placement=PoolPlacement(resource="prefill_nodes"),
        decode_placement=PoolPlacement(resource="decode_nodes"))
    cluster = LocalCluster(config)
    try:
        cluster.start()
        nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
        prefill_nodes = {ray.get(a.node_id.remote()) for a in cluster.prefill}
        decode_nodes = {ray.get(a.node_id.remote()) for a in cluster.decode}
        assert len(nodes) == 2 and len(prefill_nodes) == 1 and len(decode_nodes) == 1
        assert "prefill_nodes" in nodes[prefill_nodes.pop()]
        assert "decode_nodes" in nodes[decode_nodes.pop()]
        with grpc.insecure_channel(cluster.address) as ch:
            req = pdserve_pb2.GenerateRequest(sampling=pdserve_pb2.SamplingParams(max_tokens=8))
            req.chat.messages.add(role="user", content="What is the capital of France?")
            text = "".join(r.text for r in pdserve_pb2_grpc.GenerationStub(ch).Generate(req, timeout=120))
        assert "Paris" in text
    finally:
        cluster.stop()
        # The cluster joined this Ray and leaves it running; disconnect before the fixture's
        # `ray stop`, or this test process, still a driver of it, exits once its GCS is gone.
        ray.shutdown()
