"""A signal to ``pdserve serve``'s process group after a worker was SIGKILLed and replaced:
the cluster drains, the process exits within the drain grace plus 10 s, and no process of its
session (Ray's GCS, raylet, the ServerActors) is left running (issue 25: it left gcs_server
and three ServerActors behind, or hung on "Failed to connect to GCS within 60 seconds")."""

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.processes import session_pids

pytestmark = pytest.mark.slow

PDSERVE = Path(sys.executable).parent / "pdserve"
GRACE_S = 5


def socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    return inodes


def listening_inode(port: int) -> str:
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        parts = line.split()
        if int(parts[1].rsplit(":", 1)[1], 16) == port and parts[3] == "0A":  # 0A: LISTEN
            return parts[9]
    raise AssertionError(f"nothing listens on {port}")


def worker_pids(sid: int, router_port: int) -> set[int]:
    """The ServerActor processes of the session but the router's (the one that listens on its port)."""
    router_inode = listening_inode(router_port)
    return {pid for pid, cmd in session_pids(sid).items()
            if "ServerActor" in cmd and router_inode not in socket_inodes(pid)}


def get(address: str, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    conn.request(method, path, body=json.dumps(body) if body else None, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read() or b"{}")


def wait_for(predicate, what: str, log_path: Path, timeout_s: float = 300):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"{what}; log: {log_path.read_text()[-3000:]}")


def test_a_signal_to_the_process_group_after_a_replacement_stops_everything_in_time(tmp_path):
    """SIGTERM, which each ServerActor drains on (what the supervisor took for deaths in issue
    25). Both stop signals reach the same handler in ``pdserve serve``; SIGINT to the group is
    tests/cluster/test_cli.py's Ctrl-C, checked there to leave no process behind too."""
    sig = signal.SIGTERM
    log_path = tmp_path / "serve.log"
    log = open(log_path, "w+")
    proc = subprocess.Popen([str(PDSERVE), "serve", "--grpc-port", "0", "--port", "0", "--kv-cache-gib", "0.2",
                             "--threads-per-worker", "1", "--drain-grace-seconds", str(GRACE_S)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        found = wait_for(lambda: re.search(r"OpenAI HTTP API on http://([\d.]+:\d+)/v1", log_path.read_text()),
                         "the cluster never served", log_path)
        address = found.group(1)
        port = int(address.rsplit(":", 1)[1])
        workers = wait_for(lambda: worker_pids(proc.pid, port) if len(worker_pids(proc.pid, port)) == 2 else None,
                           "no two worker processes", log_path)
        victim = min(workers)
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: len(worker_pids(proc.pid, port) - workers) == 1, "the killed worker was not replaced",
                 log_path)
        wait_for(lambda: get(address, "GET", "/health")[0] == 200, "the cluster is not healthy again", log_path)
        status, answer = get(address, "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 2})
        assert status == 200, answer  # the replacement serves
        os.killpg(proc.pid, sig)
        # The product's bound: the drain grace plus 10 s.
        code = proc.wait(timeout=GRACE_S + 10)
        settle = time.monotonic() + 2  # processes already killed may take a moment to be reaped
        while session_pids(proc.pid) and time.monotonic() < settle:
            time.sleep(0.2)
        left = session_pids(proc.pid)
        assert not left, f"left running: {left}; exit {code}; log: {log_path.read_text()[-2000:]}"
        assert "draining" in log_path.read_text()
    finally:
        for pid in session_pids(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()
