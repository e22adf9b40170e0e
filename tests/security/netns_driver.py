"""The driver of the multi-host run: starts a pdserve cluster, asks it questions over gRPC and
HTTP, and writes what it saw as JSON. Runs inside host a's namespace for the two-host test
(``--ray-address``: prefill workers on the node offering ``prefill_nodes``, decode workers on
the ``decode_nodes`` one), or on this machine alone for the one-host baseline.

    python tests/security/netns_driver.py OUT.json [--ray-address A] [--questions Q ...]
        [--ttft-lengths 512 --ttft-repeats 5] [--tls-dir DIR] [--partition-tokens N]

With ``--partition-tokens N`` the cluster is supervised and, after the questions, the router's
host is cut off from the decode worker's gRPC port mid-stream (``partitioned``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import openai  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

from pdserve.cluster.config import ClusterConfig  # noqa: E402
from pdserve.cluster.local import LocalCluster  # noqa: E402
from pdserve.cluster.placement import PoolPlacement  # noqa: E402
from pdserve.engine.config import CacheConfig, EngineConfig  # noqa: E402
from pdserve.protos import pdserve_pb2, pdserve_pb2_grpc, worker_pb2, worker_pb2_grpc  # noqa: E402
from pdserve.wire import tls  # noqa: E402
from pdserve.wire.grpc_util import channel  # noqa: E402


PARTITION_HANG_S = 4.0  # a worker without engine progress (or any answer) this long is hung


def chat(question: str, max_tokens: int) -> pdserve_pb2.GenerateRequest:
    req = pdserve_pb2.GenerateRequest(sampling=pdserve_pb2.SamplingParams(max_tokens=max_tokens))
    req.chat.messages.add(role="user", content=question)
    return req


def stats(cluster: LocalCluster, address: str, role: str) -> worker_pb2.WorkerStats:
    cls = worker_pb2_grpc.PrefillWorkerStub if role == "prefill" else worker_pb2_grpc.DecodeWorkerStub
    with channel(address, cluster.config.tls_for("controller"), peer=role) as ch:
        return cls(ch).Stats(worker_pb2.StatsRequest(), timeout=10)


def node_ips(actors) -> list[str]:
    by_id = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    return [by_id[ray.get(a.node_id.remote())] for a in actors]


def timed(stub, cluster: LocalCluster, length: int, seed: int) -> dict:
    """TTFT, and the KV read's bytes and seconds from the decode worker's counters."""
    decode = cluster.decode_addresses[0]
    ids = torch.randint(100, 49000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
    before = stats(cluster, decode, "decode")
    req = pdserve_pb2.GenerateRequest(token_ids=pdserve_pb2.TokenIds(ids=ids),
                                      sampling=pdserve_pb2.SamplingParams(max_tokens=3, ignore_eos=True))
    t0 = time.perf_counter()
    times = [time.perf_counter() - t0 for r in stub.Generate(req, timeout=300) if r.token_ids]
    after = stats(cluster, decode, "decode")
    return {"ttft": times[0], "transfer_s": after.kv_transfer_seconds - before.kv_transfer_seconds,
            "bytes": after.kv_transfer_bytes - before.kv_transfer_bytes}


def held(cluster: LocalCluster) -> dict[str, tuple[int, int]]:
    """Every live worker's (blocks used, leases held), where either is not zero."""
    out = {}
    for role in ("prefill", "decode"):
        for address in cluster.addresses(role):
            s = stats(cluster, address, role)
            if s.num_blocks_used or s.num_held_leases:
                out[address] = (s.num_blocks_used, s.num_held_leases)
    return out


def partitioned(cluster: LocalCluster, stub, question: str, max_tokens: int) -> dict:
    """A router<->decode-worker partition: while a stream runs, this namespace (the router's
    and controller's host) drops every packet to and from the decode worker's gRPC port, so
    its connections stay open and nothing answers. The stream's tokens, against the same
    request undisturbed; how long it took; whether the worker was replaced; what is held once
    the partition heals."""
    req = chat(question, max_tokens)
    req.sampling.ignore_eos = True
    undisturbed = [t for r in stub.Generate(req, timeout=300) for t in r.token_ids]
    address = cluster.decode_addresses[0]
    host, port = address.rsplit(":", 1)
    rules = [["OUTPUT", "-d", host, "-p", "tcp", "--dport", port, "-j", "DROP"],
             ["INPUT", "-s", host, "-p", "tcp", "--sport", port, "-j", "DROP"]]
    stream = stub.Generate(req, timeout=300)
    got = list(next(stream).token_ids)
    start = time.monotonic()
    for rule in rules:
        subprocess.run(["iptables", "-I", *rule], check=True)
    try:
        got += [t for r in stream for t in r.token_ids]
        seconds = time.monotonic() - start
    finally:
        for rule in rules:
            subprocess.run(["iptables", "-D", *rule], check=True)
    deadline = time.monotonic() + 20
    while (left := held(cluster)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return {"undisturbed": undisturbed, "tokens": got, "seconds": seconds, "held": left,
            "replaced": address not in cluster.decode_addresses, "decode": cluster.decode_addresses}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--ray-address", default=None)
    ap.add_argument("--questions", nargs="*", default=["What is the capital of France?"])
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--ttft-lengths", nargs="*", type=int, default=[])
    ap.add_argument("--ttft-repeats", type=int, default=5)
    ap.add_argument("--tls-dir", type=Path, default=None, help="python -m pdserve.cluster.certs output: mTLS inside")
    ap.add_argument("--partition-tokens", type=int, default=0, help="then a stream of this many tokens partitioned")
    args = ap.parse_args()
    split = args.ray_address is not None
    role_tls = ()
    if args.tls_dir:  # each role its own identity (wire.internal_plane), as python -m pdserve.cluster.certs writes them
        d = args.tls_dir
        role_tls = tuple((role, tls.load(str(d / f"{role}.pem"), str(d / f"{role}.key"), str(d / "ca.pem"),
                                         prefix="tls")) for role in ("router", "prefill", "decode", "controller"))
    config = ClusterConfig(
        engine=EngineConfig(cache=CacheConfig(memory_budget_bytes=128 << 20)), num_prefill=1, num_decode=1,
        grpc_port=0, http_port=0, threads_per_worker=1, ray_address=args.ray_address, role_tls=role_tls,
        insecure_internal=not role_tls,  # without --tls-dir the plane is plaintext across namespaces, by choice
        # Supervised (a hung worker is replaced) only for the partition, which needs it.
        supervise_interval_s=0.5 if args.partition_tokens else None,
        hang_timeout_s=PARTITION_HANG_S if args.partition_tokens else ClusterConfig.hang_timeout_s,
        prefill_placement=PoolPlacement(resource="prefill_nodes" if split else None),
        decode_placement=PoolPlacement(resource="decode_nodes" if split else None))
    cluster = LocalCluster(config)
    result: dict = {}
    try:
        cluster.start()
        result["addresses"] = {"router": cluster.address, "router_admin": cluster.admin_address,
                               "http": cluster.http_address, "prefill": cluster.prefill_addresses,
                               "decode": cluster.decode_addresses}
        result["node_ips"] = {"prefill": node_ips(cluster.prefill), "decode": node_ips(cluster.decode),
                              "router": node_ips([cluster.router])}
        before = stats(cluster, cluster.decode_addresses[0], "decode")
        with grpc.insecure_channel(cluster.address) as ch:
            stub = pdserve_pb2_grpc.GenerationStub(ch)
            result["grpc"] = []
            for q in args.questions:
                resps = list(stub.Generate(chat(q, args.max_tokens), timeout=300))
                result["grpc"].append({"ids": [t for r in resps for t in r.token_ids],
                                       "text": "".join(r.text for r in resps)})
            client = openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="unused", max_retries=0)
            result["http"] = [client.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": q}], max_tokens=args.max_tokens,
                temperature=0).choices[0].message.content for q in args.questions]
            after = stats(cluster, cluster.decode_addresses[0], "decode")
            result["kv"] = {"transfers": after.kv_transfers - before.kv_transfers,
                            "bytes": after.kv_transfer_bytes - before.kv_transfer_bytes,
                            "failures": after.kv_transfer_failures - before.kv_transfer_failures}
            rows = []
            for length in args.ttft_lengths:
                timed(stub, cluster, 64, seed=0)  # warm-up
                runs = [timed(stub, cluster, length, seed=length * 100 + r) for r in range(args.ttft_repeats)]
                rows.append({"prompt_tokens": length, "ttft_s": statistics.median(r["ttft"] for r in runs),
                             "transfer_s": statistics.median(r["transfer_s"] for r in runs),
                             "bytes": statistics.median(r["bytes"] for r in runs)})
            result["ttft"] = rows
            if args.partition_tokens:
                result["partition"] = partitioned(cluster, stub, args.questions[0], args.partition_tokens)
    finally:
        cluster.stop()
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
