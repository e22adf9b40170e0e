"""`pdserve worker` started the way the plain-k8s Deployments start it (deploy/k8s): a router
and workers as separate processes, no Ray; the workers join the router through its
membership API on the internal plane. SIGTERM makes a decode worker leave the table and
drain within its grace period, and its stream completes on the other decode worker."""

import concurrent.futures
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from pdserve.protos import admin_pb2, admin_pb2_grpc, pdserve_pb2, pdserve_pb2_grpc, worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PDSERVE = [sys.executable, "-c", "import sys; from pdserve.cli import main; sys.exit(main())"]
GRACE_S = 1.0  # the decode worker's drain: shorter than the stream, so the stream must move


def launch(*args: str) -> subprocess.Popen:
    """`pdserve worker ARGS`, started; ``serving`` waits for it to listen."""
    return subprocess.Popen([*PDSERVE, "worker", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "PDSERVE_THREADS_PER_WORKER": "1"})


def start(name: str, *args: str) -> tuple[subprocess.Popen, str]:
    """Start `pdserve worker ARGS`; returns the process and the address it prints."""
    return serving(name, launch(*args))


def serving(name: str, proc: subprocess.Popen) -> tuple[subprocess.Popen, str]:
    """Until ``proc`` prints the address it listens on; returns the process and that address."""
    for line in proc.stdout:
        if "listening on" in line:
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep the pipe drained
            return proc, line.split("listening on ")[1].split()[0].rstrip(";,")
    raise AssertionError(f"{name} exited before serving (rc {proc.wait()})")


def members(admin: str) -> list[tuple[str, str]]:
    with grpc.insecure_channel(admin) as ch:
        table = admin_pb2_grpc.RouterAdminStub(ch).GetMembership(admin_pb2.Membership(), timeout=5)
    return sorted((m.role, m.address) for m in table.members)


def running(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return worker_pb2_grpc.DecodeWorkerStub(ch).Stats(worker_pb2.StatsRequest(), timeout=5).num_running


def health(port: int) -> int:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0  # not listening (yet, or any more)


def wait_for(predicate, what: str, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_workers_join_the_router_and_sigterm_drains_one_to_the_other(free_ports):
    grpc_port, http_port, admin_port, health_a, health_b = free_ports(5)
    procs = []
    try:
        router, address = start("router", "--role", "router", "--grpc-port", str(grpc_port), "--port",
                                str(http_port), "--internal-host", "127.0.0.1", "--internal-port", str(admin_port),
                                "--join-interval-seconds", "0.5")
        procs.append(router)
        admin = f"127.0.0.1:{admin_port}"
        common = ["--router-admin", admin, "--internal-host", "127.0.0.1", "--kv-transfer-backend", "tcp",
                  "--kv-cache-gib", "0.25", "--join-interval-seconds", "0.5", "--drain-grace-seconds", str(GRACE_S)]
        # The three load their models at once (each joins the router whenever it is ready), not
        # one after another (41 -> 33 s for this module alone on two cores).
        roles = (("prefill", 0), ("decode", health_a), ("decode", health_b))
        launched = [launch("--role", role, "--worker-id", f"{role}-{port}", "--health-port", str(port), *common)
                    for role, port in roles]
        procs += launched
        with concurrent.futures.ThreadPoolExecutor(len(roles)) as pool:  # each pipe read as it fills
            workers = list(pool.map(serving, [role for role, _ in roles], launched))
        (_, prefill), (decode_a, addr_a), (decode_b, addr_b) = workers
        want = sorted([("prefill", prefill), ("decode", addr_a), ("decode", addr_b)])
        wait_for(lambda: members(admin) == want, "all three workers in the router's table")
        wait_for(lambda: health(http_port) == 200, "the router's /health")
        # A worker is ready once its Join's answer is back (Membership.keep_joined), a moment
        # after the router's table lists it: on two busy cores one decode worker still said 503
        # when this was asserted at once (a fresh-clone run, 2026-11-29).
        wait_for(lambda: health(health_a) == health(health_b) == 200, "both decode workers' /health")

        request = pdserve_pb2.GenerateRequest(text="Count to a thousand:", sampling=pdserve_pb2.SamplingParams(
            max_tokens=200, ignore_eos=True, temperature=0.0))
        with grpc.insecure_channel(address) as ch:
            stream = pdserve_pb2_grpc.GenerationStub(ch).Generate(request, timeout=300)
            tokens = len(next(stream).token_ids)
            busy = wait_for(lambda: [a for a in (addr_a, addr_b) if running(a)], "a decode worker with the stream")
            victim, victim_health = ((decode_a, health_a) if busy[0] == addr_a else (decode_b, health_b))
            victim.send_signal(signal.SIGTERM)
            wait_for(lambda: health(victim_health) != 200, "the drained worker's /health to leave 200")
            wait_for(lambda: ("decode", busy[0]) not in members(admin), "the drained worker to leave the table")
            assert victim.wait(timeout=GRACE_S + 60) == 0
            last = None
            for last in stream:
                tokens += len(last.token_ids)
        assert last.finish_reason == pdserve_pb2.FINISH_REASON_LENGTH
        assert tokens == 200
        survivor = addr_b if busy[0] == addr_a else addr_a
        assert members(admin) == sorted([("prefill", prefill), ("decode", survivor)])
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
