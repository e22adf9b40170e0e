"""Two hosts on one machine: network namespaces joined by a veth pair (tests/security/netns.py),
a Ray node in each. Prefill workers run on host a (10.77.0.1), decode workers on host b
(10.77.0.2); each binds only its own address. The router (with the driver) is on host a. Greedy
output through gRPC and HTTP equals transformers, and the KV really crosses the veth. Then host a
drops every packet to and from the decode worker's gRPC port while a stream runs: a router<->worker
partition (the conformance suite's, docs/reliability.md).

Before bind and advertised addresses were set apart this failed: every server advertised
127.0.0.1, which from the other namespace is that namespace's own loopback.
"""

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from tests.helpers.chat import assert_chat_greedy
from tests.security.netns import ADDRESSES, two_hosts

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                                 reason="network namespaces need root and iproute2")]

DRIVER = Path(__file__).with_name("netns_driver.py")
QUESTIONS = ["What is the capital of France?", "Name three prime numbers."]
MAX_TOKENS = 16
PARTITION_TOKENS = 48
REQUEST_TIMEOUT_S = 300.0  # the partitioned stream's deadline (netns_driver.partitioned)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("multihost") / "result.json"
    # The namespaces share one kernel, so UCX would move the KV through shared memory / CMA,
    # which needs no network at all. Two real hosts have only the network: UCX is held to TCP
    # here, so the read goes through the veth and the address NIXL advertises must be reachable.
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "UCX_TLS": "tcp,self"}
    with two_hosts(env) as hosts:
        tx_before = {h: hosts.tx_bytes(h) for h in ("a", "b")}
        done = hosts.run("a", [sys.executable, str(DRIVER), str(out), "--ray-address", hosts.ray_address,
                               "--max-tokens", str(MAX_TOKENS), "--partition-tokens", str(PARTITION_TOKENS),
                               "--questions", *QUESTIONS],
                         timeout=600, env=env, capture_output=True, text=True)
        tx = {h: hosts.tx_bytes(h) - tx_before[h] for h in ("a", "b")}
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return json.loads(out.read_text()), tx


def test_each_pool_binds_and_advertises_its_own_host(run):
    result, _ = run
    a, b = ADDRESSES["a"], ADDRESSES["b"]
    assert result["node_ips"] == {"prefill": [a], "decode": [b], "router": [a]}
    assert [x.rsplit(":", 1)[0] for x in result["addresses"]["prefill"]] == [a]
    assert [x.rsplit(":", 1)[0] for x in result["addresses"]["decode"]] == [b]
    assert result["addresses"]["router_admin"].startswith(f"{a}:")
    assert result["addresses"]["router"].startswith("127.0.0.1:")  # the public API: --host, on host a


def test_greedy_over_grpc_and_http_equals_transformers(run, reference):
    result, _ = run
    for q, got, http_text in zip(QUESTIONS, result["grpc"], result["http"]):
        assert_chat_greedy(reference, q, got["ids"], MAX_TOKENS)
        assert http_text == got["text"], q


def test_kv_crossed_between_the_hosts(run):
    """Every request's KV moved from host a to host b, and at least that many bytes left host
    a through the veth."""
    result, tx = run
    kv = result["kv"]
    assert kv["transfers"] == 2 * len(QUESTIONS) and kv["failures"] == 0  # gRPC, then HTTP
    assert kv["bytes"] > 0 and tx["a"] >= kv["bytes"]


def test_a_partitioned_decode_worker_is_replaced_and_the_stream_completes_unchanged(run):
    """Packets between the router's host and the decode worker's gRPC port are dropped mid-stream
    (its connections stay open; nothing answers): the worker is found hung, replaced on its
    host, and the stream continues there with exactly the undisturbed tokens, within its
    deadline. Once the partition heals no live worker holds a block or a lease."""
    result, _ = run
    p = result["partition"]
    assert len(p["undisturbed"]) == PARTITION_TOKENS
    assert p["tokens"] == p["undisturbed"]
    assert p["replaced"] and [x.rsplit(":", 1)[0] for x in p["decode"]] == [ADDRESSES["b"]]
    assert p["seconds"] < REQUEST_TIMEOUT_S
    assert p["held"] == {}
    print(f"partition: stream completed {p['seconds']:.1f} s after the partition began")
