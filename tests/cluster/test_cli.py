"""The README's first command: ``pdserve serve`` starts the cluster, answers, and stops on Ctrl-C."""

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

PDSERVE = Path(sys.executable).parent / "pdserve"


def test_help_lists_the_commands():
    out = subprocess.run([str(PDSERVE), "--help"], capture_output=True, text=True, check=True).stdout
    assert "serve" in out and "generate" in out
    serve = subprocess.run([str(PDSERVE), "serve", "--help"], capture_output=True, text=True, check=True).stdout
    for flag in ("--prefill", "--decode", "--port", "--dtype", "--block-size", "--kv-transfer-backend"):
        assert flag in serve


def test_serve_generate_and_ctrl_c(tmp_path):
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([str(PDSERVE), "serve", "--grpc-port", "0", "--port", "0", "--kv-cache-gib", "0.2"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        address = None
        deadline = time.monotonic() + 180
        while address is None and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
            found = re.search(r"gRPC API listening on ([\d.]+:\d+)", (tmp_path / "serve.log").read_text())
            address = found and found.group(1)
        assert address, (tmp_path / "serve.log").read_text()[-3000:]
        out = subprocess.run([str(PDSERVE), "generate", "What is the capital of France?", "--address", address,
                              "--max-tokens", "12"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert "Paris" in out.stdout and "prompt +" in out.stdout
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 0
        host, port = address.rsplit(":", 1)
        with socket.socket() as s:
            assert s.connect_ex((host, int(port))) != 0, "the router still listens after Ctrl-C"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
