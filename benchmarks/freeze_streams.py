"""A hang under load, measured (issue 55): `pdserve serve`'s default layout (one prefill, one
decode worker, the default model), N concurrent greedy chat streams over the OpenAI HTTP API,
and one worker frozen with SIGSTOP (it keeps its sockets and never answers) some seconds in.
Counted per fault: streams complete / failed (and why), the time until the last one ended, and
whether every text equals the undisturbed run's. A measurement, not a test: it starts a real
cluster, on free ports, and stops it (and thaws whatever it froze) however it ends.

    .venv/bin/python benchmarks/freeze_streams.py                      # prefill 0.3 s, decode 3 s
    .venv/bin/python benchmarks/freeze_streams.py --faults prefill@0.3 --streams 12

The frozen worker is found by its /metrics port (the router's /metrics/targets lists every
worker's, with its pool) and the process listening there. The supervisor may replace it
meanwhile (a hung worker is killed and restarted after --hang-timeout-seconds); between faults
the script thaws it and waits for /health."""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import secrets
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.serving_procs import ServerProcess, http_get  # noqa: E402

HOST = "127.0.0.1"
QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Why is the sky blue?",
             "Write a haiku about rain.", "What does a CPU do?", "Give me a tip for learning Python.",
             "How many legs does a spider have?", "What is photosynthesis?", "Describe a cat in one sentence.",
             "What is 12 times 12?", "Why do we sleep?", "What is the tallest mountain on Earth?"]


@dataclass
class Stream:
    text: str = ""
    error: str | None = None
    took_s: float = 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def processor() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def prompt(i: int, context_words: int) -> str:
    """Stream ``i``'s question after ``context_words`` words of its own context (nothing shared
    with the other prompts, so no prefix cache shortens a prefill)."""
    words = [f"item{i}-{k}" for k in range(context_words)]
    return f"Context {i}: {' '.join(words)}\n\n{QUESTIONS[i % len(QUESTIONS)]}"


def one_stream(port: int, question: str, max_tokens: int, deadline_s: float, salt: str, out: Stream) -> None:
    """One streamed chat completion; its text, or the error it ended with. ``salt``: its run's
    ``cache_salt``, so that no run finds the KV of another in a prefix cache (a run that found
    the undisturbed run's prompts cached on the decode worker would prefill nothing remotely)."""
    body = json.dumps({"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
                       "temperature": 0, "stream": True, "timeout": deadline_s, "cache_salt": salt})
    start = time.monotonic()
    conn = http.client.HTTPConnection(HOST, port, timeout=deadline_s + 30)
    try:
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            out.error = f"{resp.status} {resp.read()[:300].decode(errors='replace')}"
            return
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out.error = f"stream error: {event['error'].get('message')}"
                return
            out.text += event["choices"][0]["delta"].get("content") or ""
    except OSError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    finally:
        out.took_s = time.monotonic() - start
        conn.close()


def worker_pid(port: int, pool: str) -> int:
    """The pid of the (first) worker of ``pool``: the process listening on its /metrics port."""
    status, body = http_get(HOST, port, "/metrics/targets")
    targets = [t["targets"][0] for t in json.loads(body) if t["labels"]["pool"] == pool]
    if status != 200 or not targets:
        raise RuntimeError(f"no {pool} worker in /metrics/targets ({status}: {body[:200]!r})")
    metrics_port = int(targets[0].rsplit(":", 1)[1])
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == metrics_port and conn.pid:
            return conn.pid
    raise RuntimeError(f"no process listens on {pool} worker's metrics port {metrics_port}")


def run(port: int, n: int, max_tokens: int, deadline_s: float, freeze: tuple[str, float] | None,
        context_words: int = 0) -> tuple[list[Stream], float, int | None]:
    """``n`` concurrent streams; with ``freeze`` (pool, seconds) that pool's worker is stopped
    that long after they start. Returns the streams, the wall time of the slowest, the frozen pid."""
    streams, salt = [Stream() for _ in range(n)], secrets.token_hex(8)
    threads = [threading.Thread(target=one_stream, args=(port, prompt(i, context_words), max_tokens,
                                                         deadline_s, salt, s)) for i, s in enumerate(streams)]
    pid = worker_pid(port, freeze[0]) if freeze else None
    start = time.monotonic()
    for t in threads:
        t.start()
    if freeze:
        time.sleep(freeze[1])
        os.kill(pid, signal.SIGSTOP)
    for t in threads:
        t.join()
    return streams, time.monotonic() - start, pid


def thaw(pid: int | None) -> None:
    if pid is not None:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass  # the supervisor replaced it


def wait_healthy(port: int, timeout_s: float = 300) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            if http_get(HOST, port, "/health")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"not healthy after {timeout_s:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--context-words", type=int, default=150,
                        help="words of context before each question: prefill work the freeze can catch")
    parser.add_argument("--deadline", type=float, default=60.0, help="each stream's `timeout`, seconds")
    parser.add_argument("--faults", nargs="+", default=["prefill@0.3", "decode@3"], help="POOL@SECONDS ...")
    parser.add_argument("--serve-flags", default="", help="more `pdserve serve` flags")
    parser.add_argument("--log", type=Path, default=Path("/tmp/freeze_streams_server.log"))
    args = parser.parse_args()
    http_port, grpc_port = free_port(), free_port()
    cmd = [str(Path(sys.executable).parent / "pdserve"), "serve", "--port", str(http_port),
           "--grpc-port", str(grpc_port), *args.serve_flags.split()]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    print(f"processor: {processor()}; {os.cpu_count()} cpus; {' '.join(cmd)}", flush=True)
    with ServerProcess("pdserve", cmd, env, HOST, [http_port, grpc_port], args.log) as server:
        server.wait_healthy(600, lambda _: None)
        run(http_port, 2, 8, args.deadline, None)  # warm
        base, took, _ = run(http_port, args.streams, args.max_tokens, args.deadline, None, args.context_words)
        print(f"undisturbed: {sum(s.error is None for s in base)}/{args.streams} complete in {took:.1f} s", flush=True)
        for fault in args.faults:
            pool, at = fault.split("@")
            streams, took, pid = run(http_port, args.streams, args.max_tokens, args.deadline, (pool, float(at)),
                                     args.context_words)
            thaw(pid)
            done = [s for s in streams if s.error is None]
            same = sum(s.error is None and s.text == b.text for s, b in zip(streams, base))
            print(f"{pool} SIGSTOPped {at} s in: {len(done)}/{args.streams} complete, "
                  f"{args.streams - len(done)} failed, last ended at {took:.1f} s, "
                  f"{same}/{args.streams} texts equal the undisturbed run's; "
                  f"slowest stream {max(s.took_s for s in streams):.1f} s", flush=True)
            for s in streams:
                if s.error:
                    print(f"  failed after {s.took_s:.1f} s: {s.error}", flush=True)
            wait_healthy(http_port)


if __name__ == "__main__":
    main()
