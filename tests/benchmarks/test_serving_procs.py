"""Server processes of the serving benchmark (benchmarks/serving_procs.py): health wait, port
checks, and that stop() leaves nothing behind, also a child that left the group (as Ray's do)."""

from __future__ import annotations

import socket
import sys
import textwrap

import psutil
import pytest

from benchmarks.serving_procs import ServerError, ServerExited, ServerProcess, port_free, run_teed

# A /health server that first starts a grandchild in a session of its own, the way Ray's
# daemons leave the server's process group, and writes its pid to a file. It stops on SIGINT
# as pdserve and vLLM do: a process started in the background (as CI may start the suite)
# inherits SIGINT ignored, and the fake server then sat out stop()'s 30 s SIGINT wait.
SERVER = textwrap.dedent("""
    import http.server, signal, subprocess, sys
    signal.signal(signal.SIGINT, signal.default_int_handler)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    open(sys.argv[2], "w").write(str(child.pid))
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_stop_ends_the_tree_including_a_child_in_its_own_session(tmp_path):
    port, pidfile = free_port(), tmp_path / "child.pid"
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    server = ServerProcess("fake", [sys.executable, str(script), str(port), str(pidfile)], {}, "127.0.0.1",
                           [port], tmp_path / "fake.log")
    with server:
        server.wait_healthy(30, lambda t: None)
        root = psutil.Process(server.proc.pid)
        child = psutil.Process(int(pidfile.read_text()))
        assert child.is_running() and child.pid in {p.pid for p in root.children(recursive=True)}
    assert not root.is_running()
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    assert port_free("127.0.0.1", port)


def test_busy_port_is_refused_before_anything_starts(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        server = ServerProcess("fake", [sys.executable, "-c", "pass"], {}, "127.0.0.1", [port], tmp_path / "x.log")
        with pytest.raises(ServerError, match=rf"fake: port\(s\) \[{port}\].*in use"):
            server.__enter__()
        assert server.proc is None


def test_server_that_exits_early_reports_its_log(tmp_path):
    server = ServerProcess("fake", [sys.executable, "-c", "print('no weights here'); raise SystemExit(3)"], {},
                           "127.0.0.1", [free_port()], tmp_path / "x.log")
    with server, pytest.raises(ServerError, match=r"(?s)fake exited with 3.*no weights here"):
        server.wait_healthy(30, lambda t: None)


def test_run_teed_returns_the_exit_code_and_keeps_the_output(tmp_path, capfd):
    log = tmp_path / "out.log"
    rc = run_teed([sys.executable, "-c", "import sys; print('progress 50%'); sys.exit(4)"], {}, log)
    assert rc == 4
    assert "progress 50%" in log.read_text()
    assert "progress 50%" in capfd.readouterr().out


def test_run_teed_calls_each_mark_once_when_its_text_appears_even_split_between_reads(tmp_path):
    # the first mark is written in two flushes with a pause between, so two reads see its halves
    script = ("import sys, time\n"
              "print('warmup'); sys.stdout.write('Starting main bench'); sys.stdout.flush(); time.sleep(0.3)\n"
              "print('mark run'); sys.stdout.flush(); time.sleep(0.3)\n"
              "print('== Result =='); print('== Result ==')\n")
    seen = []
    rc = run_teed([sys.executable, "-c", script], {}, tmp_path / "out.log",
                  marks={b"Starting main benchmark run": lambda: seen.append("start"),
                         b"== Result ==": lambda: seen.append("end"), b"never printed": lambda: seen.append("no")})
    assert rc == 0
    assert seen == ["start", "end"]


def test_a_server_that_exits_before_healthy_is_started_again(tmp_path):
    import argparse

    from benchmarks.serving_run import start

    port, marker = free_port(), tmp_path / "tried"
    script = tmp_path / "flaky.py"
    # the first start exits (as pdserve does when Ray's raylet misses its 30 s), the second serves
    script.write_text("import os, sys\n"
                      f"if not os.path.exists({str(marker)!r}):\n"
                      f"    open({str(marker)!r}, 'w').close(); sys.exit(1)\n" + SERVER)
    server = ServerProcess("flaky", [sys.executable, str(script), str(port), str(tmp_path / "child.pid")], {},
                           "127.0.0.1", [port], tmp_path / "flaky.log")
    steps = []
    with server:
        _, attempt = start(argparse.Namespace(start_attempts=2, startup_timeout=30), server, steps.append)
    assert attempt == 2 and len(steps) == 2
    assert port_free("127.0.0.1", port)


def test_start_gives_up_after_the_last_attempt(tmp_path):
    import argparse

    from benchmarks.serving_run import start

    server = ServerProcess("broken", [sys.executable, "-c", "raise SystemExit(1)"], {}, "127.0.0.1",
                           [free_port()], tmp_path / "b.log")
    with server, pytest.raises(ServerExited):
        start(argparse.Namespace(start_attempts=2, startup_timeout=30), server, lambda msg: None)
