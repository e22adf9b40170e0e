"""The README's first command: ``pdserve serve`` starts the cluster, answers (``pdserve
generate`` over gRPC, and the README's own ``openai`` example, run as written, over HTTP),
and stops on Ctrl-C (SIGINT to its process group, as a terminal sends it), leaving no process
behind."""

import contextlib
import io

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.processes import session_pids

pytestmark = pytest.mark.slow

PDSERVE = Path(sys.executable).parent / "pdserve"


def help_text(argv: list[str]) -> str:
    """What ``pdserve ARGV`` prints and exits 0 on, from the command's own ``main`` in this process
    (each run of the installed script imports torch again: seconds apiece on this box)."""
    from pdserve.cli import main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 0
    return printed.getvalue()


def test_help_lists_the_commands():
    out = help_text(["--help"])
    assert "serve" in out and "generate" in out
    serve = help_text(["serve", "--help"])
    for flag in ("--prefill", "--decode", "--port", "--grpc-port", "--dtype", "--block-size", "--kv-transfer-backend",
                 "--served-model-name", "--max-num-seqs", "--max-num-batched-tokens", "--enable-prefix-caching",
                 "--no-enable-prefix-caching", "--chat-template", "--tokenizer", "--seed", "--log-level",
                 "--log-format", "--version"):
        assert flag in serve, flag
    # the installed script itself, as a user runs it
    version = subprocess.run([str(PDSERVE), "--version"], capture_output=True, text=True, check=True).stdout
    assert re.fullmatch(r"pdserve \d+\.\d+\.\d+\n", version), version


def readme_example(http_address: str) -> str:
    """The README's first Python block, pointed at ``http_address`` instead of port 8000."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    assert "127.0.0.1:8000" in block, block
    return block.replace("127.0.0.1:8000", http_address)


def test_serve_generate_and_ctrl_c(tmp_path):
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([str(PDSERVE), "serve", "--grpc-port", "0", "--port", "0", "--kv-cache-gib", "0.2"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        address = None
        deadline = time.monotonic() + 180
        while address is None and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            found = re.search(r"OpenAI HTTP API on http://([\d.]+:\d+)/v1, gRPC API listening on ([\d.]+:\d+)",
                              (tmp_path / "serve.log").read_text())
            http_address, address = found.groups() if found else (None, None)
        assert address, (tmp_path / "serve.log").read_text()[-3000:]
        example, printed = {}, io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(readme_example(http_address), example)
        assert "Paris" in printed.getvalue()
        assert example["reply"].choices[0].finish_reason == "stop", printed.getvalue()  # not cut short
        out = subprocess.run([str(PDSERVE), "generate", "What is the capital of France?", "--address", address,
                              "--max-tokens", "12"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert "Paris" in out.stdout and "prompt +" in out.stdout
        # Ctrl-C in a terminal: SIGINT to the whole foreground process group, Ray's processes
        # included. It exits 0 and leaves no process of its session behind (the same after a
        # worker's replacement, and for SIGTERM: tests/cluster/test_shutdown_after_replacement.py).
        os.killpg(proc.pid, signal.SIGINT)
        try:
            code = proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGUSR1)  # serve writes every thread's stack to its log
            time.sleep(2)
            raise AssertionError("pdserve serve did not exit 90 s after SIGINT; its log ends:\n"
                                 + (tmp_path / "serve.log").read_text()[-8000:]) from None
        assert code == 0, (tmp_path / "serve.log").read_text()[-3000:]
        settle = time.monotonic() + 2  # processes already killed may take a moment to be reaped
        while session_pids(proc.pid) and time.monotonic() < settle:
            time.sleep(0.2)
        assert not session_pids(proc.pid), session_pids(proc.pid)
        host, port = address.rsplit(":", 1)
        with socket.socket() as s:
            assert s.connect_ex((host, int(port))) != 0, "the router still listens after Ctrl-C"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
