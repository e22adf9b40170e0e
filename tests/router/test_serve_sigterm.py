"""SIGTERM to ``pdserve serve`` drains the cluster: admission stops, every in-flight stream
finishes, then the process exits 0 (the signal Kubernetes sends before it kills a pod)."""

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

PDSERVE = Path(sys.executable).parent / "pdserve"
STREAMS = 3
MAX_TOKENS = 48


def stream(address: str, first_token: threading.Event, out: dict) -> None:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    body = {"messages": [{"role": "user", "content": "Count from one to one hundred."}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    out["status"], out["events"] = resp.status, []
    for line in resp:
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        out["events"].append(data)
        if data != b"[DONE]" and json.loads(data).get("choices") and json.loads(data)["choices"][0]["delta"].get("content"):
            first_token.set()
    conn.close()


def status_of(address: str, method: str, path: str, body: bytes | None = None) -> int | None:
    host, port = address.rsplit(":", 1)
    try:
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        return conn.getresponse().status
    except OSError:
        return None  # the router is gone already


def test_sigterm_finishes_every_in_flight_stream_then_exits_0(tmp_path):
    log_path = tmp_path / "serve.log"
    log = open(log_path, "w+")
    proc = subprocess.Popen([str(PDSERVE), "serve", "--grpc-port", "0", "--port", "0", "--kv-cache-gib", "0.2",
                             "--threads-per-worker", "1", "--drain-grace-seconds", "240"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        address = None
        deadline = time.monotonic() + 240
        while address is None and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            found = re.search(r"OpenAI HTTP API on http://([\d.]+:\d+)/v1", log_path.read_text())
            address = found and found.group(1)
        assert address, log_path.read_text()[-3000:]
        outs = [{} for _ in range(STREAMS)]
        firsts = [threading.Event() for _ in range(STREAMS)]
        threads = [threading.Thread(target=stream, args=(address, f, o)) for f, o in zip(firsts, outs)]
        for t in threads:
            t.start()
        for f in firsts:
            assert f.wait(180), "a stream got no first token"
        proc.send_signal(signal.SIGTERM)
        # While draining, the router refuses new work (503), or has already gone (None).
        health = None
        for _ in range(100):
            health = status_of(address, "GET", "/health")
            if health != 200:
                break
            time.sleep(0.05)
        assert health in (503, None)
        late = status_of(address, "POST", "/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 2}).encode())
        assert late in (503, None)
        for t in threads:
            t.join(300)
        assert proc.wait(timeout=120) == 0, log_path.read_text()[-3000:]
        for out in outs:
            assert out["status"] == 200 and out["events"][-1] == b"[DONE]"
            chunks = [json.loads(e) for e in out["events"][:-1]]
            assert not [c for c in chunks if "error" in c], chunks[-3:]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
            content = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
            assert len(content) >= MAX_TOKENS // 2  # the stream ran to its end, not cut at the signal
        assert "draining" in log_path.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
