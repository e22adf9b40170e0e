"""Processes of the serving benchmark (benchmarks/serving.py): a server, its load generator, and
the py-spy recorders, each started so that it is stopped again on success, error and Ctrl-C.

A server runs in a session of its own (its own process group), so one signal reaches the whole
tree. Some of a tree leave that group: Ray starts its daemons and actors in sessions of their
own. So every descendant seen while the server runs is remembered by pid and creation time, and
whatever of them outlives the group's shutdown is killed by pid; the creation time makes sure a
pid the kernel has since reused is never hit.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import psutil


class ServerError(RuntimeError):
    """A server did not start, did not become healthy, or its load generator failed."""


class ServerExited(ServerError):
    """A server exited before it was healthy (Ray gives its raylet a fixed 30 s to register, which a
    busy machine can miss): worth another attempt."""


def port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def http_get(host: str, port: int, path: str, timeout: float = 3.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


class ServerProcess:
    """One server (pdserve or vLLM) as a context manager: started on enter, stopped on exit."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], host: str, ports: list[int],
                 log: Path):
        self.name, self.cmd, self.env, self.host = name, cmd, env, host
        self.ports = ports  # the first one serves /health and /v1
        self.log = log
        self.proc: subprocess.Popen | None = None
        self._seen: dict[int, float] = {}  # pid -> create_time of every process of the tree seen

    def __enter__(self) -> "ServerProcess":
        busy = [p for p in self.ports if not port_free(self.host, p)]
        if busy:
            raise ServerError(f"{self.name}: port(s) {busy} on {self.host} are in use; pick others "
                              "(--pdserve-port/--vllm-port) or stop what listens there")
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("a") as out:
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        self._seen[self.proc.pid] = psutil.Process(self.proc.pid).create_time()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def port(self) -> int:
        return self.ports[0]

    def descendants(self) -> list[psutil.Process]:
        """The live processes of the tree; also remembers them for stop()."""
        try:
            procs = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        for p in procs:
            try:
                self._seen.setdefault(p.pid, p.create_time())
            except psutil.NoSuchProcess:
                pass
        return procs

    def wait_healthy(self, timeout_s: float, tick: Callable[[float], None]) -> float:
        """Poll GET /health until 200; returns seconds since start. tick(elapsed) drives a progress bar."""
        t0 = time.monotonic()
        while (elapsed := time.monotonic() - t0) < timeout_s:
            if self.proc.poll() is not None:
                raise ServerExited(f"{self.name} exited with {self.proc.returncode} before it was healthy:\n"
                                  + self.log_tail())
            self.descendants()
            try:
                if http_get(self.host, self.port, "/health")[0] == 200:
                    return elapsed
            except OSError:
                pass
            tick(elapsed)
            time.sleep(1.0)
        raise ServerError(f"{self.name} not healthy after {timeout_s:.0f} s (log: {self.log}):\n" + self.log_tail())

    def served_model(self) -> str:
        status, body = http_get(self.host, self.port, "/v1/models")
        if status != 200:
            raise ServerError(f"{self.name}: GET /v1/models answered {status}: {body[:200]!r}")
        return json.loads(body)["data"][0]["id"]

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """SIGINT, SIGTERM, SIGKILL to the group, then kill survivors of the tree by pid."""
        if self.proc is None:
            return
        self.descendants()
        for sig, wait_s in ((signal.SIGINT, 30), (signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                continue
        self._kill_survivors()
        self.proc = None

    def _kill_survivors(self) -> None:
        survivors = []
        for pid, created in self._seen.items():
            try:
                p = psutil.Process(pid)
                if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                    survivors.append(p)
            except psutil.NoSuchProcess:
                continue
        for p in survivors:
            p.terminate()
        _, alive = psutil.wait_procs(survivors, timeout=10)
        for p in alive:
            p.kill()
        psutil.wait_procs(alive, timeout=5)
        if survivors:
            print(f"[serving] {self.name}: stopped {len(survivors)} process(es) that outlived the group",
                  flush=True)


def run_teed(cmd: list[str], env: dict[str, str], log: Path,
             marks: dict[bytes, Callable[[], None]] | None = None) -> int:
    """Run a command in its own group, copying its output (progress bars included) to the
    terminal and to log; on any exception (Ctrl-C included) the group is killed. marks: each
    callback runs once, as soon as its text first appears in the output."""
    log.parent.mkdir(parents=True, exist_ok=True)
    pending = dict(marks or {})
    keep = max((len(t) for t in pending), default=1) - 1
    tail = b""  # the end of the previous chunk, for a mark split between two reads
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        with log.open("wb") as out:
            while chunk := os.read(proc.stdout.fileno(), 4096):
                seen = tail + chunk
                for text in [t for t in pending if t in seen]:
                    pending.pop(text)()
                tail = seen[-keep:] if keep else b""
                out.write(chunk)
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()
        return proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.stdout.close()


class Profiler:
    """py-spy recorders, one per pid, as raw collapsed stacks; stopped with SIGINT, on which py-spy
    writes its file (speedscope and flamegraph.pl read this format). 20 Hz, non-blocking: at 50 Hz
    each recorder took ~9% of a core on this 2-core machine, which the servers then lack."""

    def __init__(self, py_spy: Path, rate_hz: int = 20):
        self.py_spy, self.rate_hz = py_spy, rate_hz
        self._procs: list[tuple[subprocess.Popen, Path]] = []

    def start(self, pid: int, out: Path) -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = [str(self.py_spy), "record", "--pid", str(pid), "--rate", str(self.rate_hz), "--nonblocking",
               "--function", "--format", "raw", "--output", str(out)]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=out.with_suffix(".log").open("w"),
                                stdin=subprocess.DEVNULL, start_new_session=True)
        self._procs.append((proc, out))

    def stop(self) -> list[Path]:
        """Stops every recorder; returns the files written."""
        for proc, _ in self._procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
        written = []
        for proc, out in self._procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            if out.exists():
                written.append(out)
        self._procs.clear()
        return written


def classify_worker(py_spy: Path, pid: int) -> str | None:
    """'prefill', 'decode' or 'router' for a pdserve ServerActor process, read from the name of
    the thread its server runs in (wire.server.ServerThread(name=role)), as py-spy dump prints it:
    'Thread 0x7F.. (idle): "decode"'; None if unknown."""
    try:
        dump = subprocess.run([str(py_spy), "dump", "--pid", str(pid), "--nonblocking"], capture_output=True,
                              text=True, timeout=60).stdout
    except subprocess.TimeoutExpired:
        return None
    found = re.search(r'^Thread \S+ \([^)]*\): "(prefill|decode|router)"$', dump, re.MULTILINE)
    return found.group(1) if found else None


def server_actor_pids(server: ServerProcess) -> list[int]:
    """pids of pdserve's role processes (Ray sets their title to ray::ServerActor...)."""
    pids = []
    for p in server.descendants():
        try:
            if " ".join(p.cmdline()).startswith("ray::ServerActor"):
                pids.append(p.pid)
        except psutil.NoSuchProcess:
            continue
    return pids


# ---- CPU accounting: how many cores the machine and the server's tree kept busy ----
def cpu_seconds(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            continue
    return total


def cpu_shares(a: tuple[float, float, float], b: tuple[float, float, float]) -> dict[str, float]:
    """Average busy cores between two (time, machine busy s, server cpu s) marks."""
    wall = max(b[0] - a[0], 1e-9)
    return {"busy_cores": round((b[1] - a[1]) / wall, 2), "server_cores": round((b[2] - a[2]) / wall, 2),
            "window_s": round(wall, 1)}


def busy_seconds() -> float:
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def server_tree(server: ServerProcess) -> list[psutil.Process]:
    return [psutil.Process(server.proc.pid), *server.descendants()]
