"""How long ``GET /health`` takes while clients flood the router: with large bodies (issue 25),
or with valid hostile generations (``--hostile``, issue 41).

Bodies: starts a real router in a process of its own (the default model's tokenizer, no
workers: /health answers 503, which measures the event loop just as well), sends ``--clients``
concurrent bodies of ``--mb`` MB of token ids from this process, and polls /health every
20 ms until the flood is answered. Prints the /health latencies (max, p50) and how long the
flood took.

    .venv/bin/python scripts/health_under_flood.py --clients 20 --mb 3.8

Hostile (``--hostile``): starts the real cluster (``pdserve serve``, the default model,
``--tool-call-parser hermes``), and ``--clients`` clients (in a process of their own) send,
back to back for ``--duration`` seconds, one of three valid requests each (client i the kind
i % 3): a long stream of partial UTF-8 (logit_bias forcing the byte tokens 0xF0, an emoji's
first byte, and 0x80, which cannot follow it: never a whole character), a long stream of tool
calls (one hermes call per 48 tokens of ``--max-tokens``, forced by guided_regex) and a chat
request with a schema no one sent before. /health is polled every
20 ms meanwhile. Prints /health p50/p99/max and ``pdserve:router_loop_lag_seconds`` over the
run (from the router's /metrics before and after: p99 and max as histogram bucket bounds),
against the issue's targets (/health p99 < 100 ms, loop lag < 50 ms).

    .venv/bin/python scripts/health_under_flood.py --hostile --clients 20 --duration 120
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import multiprocessing
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _request(address: str, method: str, path: str, body: bytes | None = None) -> int:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
    status = conn.getresponse().status
    conn.close()
    return status


def serve() -> None:
    """The router, until stdin closes; prints its HTTP address first."""
    from pdserve.router import server

    loop = asyncio.new_event_loop()
    running = loop.run_until_complete(server.start(server.RouterConfig(grpc_port=0, http_port=0)))
    print(running.http_address, flush=True)
    threading.Thread(target=loop.run_forever, daemon=True).start()
    sys.stdin.read()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--mb", type=float, default=3.8)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--path", default="/detokenize", choices=("/detokenize", "/v1/completions"),
                        help="/v1/completions sends the ids as a prompt")
    parser.add_argument("--hostile", action="store_true", help="hostile generations on the real cluster instead")
    parser.add_argument("--duration", type=float, default=120.0, help="--hostile: seconds of load")
    parser.add_argument("--max-tokens", type=int, default=1024, help="--hostile: tokens per streamed request")
    parser.add_argument("--schema-depth", type=int, default=24, help="--hostile: nesting of each fresh schema")
    parser.add_argument("--port", type=int, default=8341, help="--hostile: the cluster's HTTP port")
    parser.add_argument("--grpc-port", type=int, default=50341, help="--hostile: the cluster's gRPC port")
    args = parser.parse_args()
    if args.serve:
        return serve()
    if args.hostile:
        return hostile(args)
    router = subprocess.Popen([sys.executable, __file__, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    address = router.stdout.readline().strip()
    ids = "1234, " * int(args.mb * 1e6 / 6)
    key = "tokens" if args.path == "/detokenize" else "prompt"
    body = ('{"' + key + '": [' + ids + '1]}').encode()
    statuses: list[int] = []
    flood = [threading.Thread(target=lambda: statuses.append(_request(address, "POST", args.path, body)))
             for _ in range(args.clients)]
    began = time.monotonic()
    for t in flood:
        t.start()
    latencies = []
    while any(t.is_alive() for t in flood):
        start = time.monotonic()
        _request(address, "GET", "/health")
        latencies.append(time.monotonic() - start)
        time.sleep(0.02)
    took = time.monotonic() - began
    router.stdin.close()
    router.wait(30)
    print(json.dumps({"clients": args.clients, "body_mb": round(len(body) / 1e6, 2), "flood_s": round(took, 2),
                      "flood_statuses": sorted(set(statuses)), "health_polls": len(latencies),
                      "health_max_ms": round(1000 * max(latencies), 1),
                      "health_p50_ms": round(1000 * statistics.median(latencies), 1)}))


# ---- --hostile: valid hostile generations on the real cluster ---------------------------------
LOOP_LAG = "pdserve:router_loop_lag_seconds"
# One tool call (~25-40 tokens); a streamed answer holds one per 48 tokens it may have.
CALL_REGEX = r'<tool_call>\{"name": "f", "arguments": \{"a": "[a-z]{1,8}"\}\}</tool_call>\n'
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}}}]


def _byte_token_ids() -> list[int]:
    """The ids of the default model's tokens that are the bytes 0xF0 and 0x80 alone (the first
    and last bytes of U+1F600), found through its byte-level alphabet (so on any checkout)."""
    from tokenizers.pre_tokenizers import ByteLevel

    from pdserve.engine.loader import materialize
    from pdserve.engine.tokenizer import Tokenizer

    chars = ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str("\U0001F600")[0][0]
    return Tokenizer(materialize("default", progress=False)).hf.convert_tokens_to_ids([chars[0], chars[3]])


def _fresh_schema(rng: random.Random, depth: int) -> dict:
    """Objects nested ``depth`` deep, named at random: a schema the router has never converted."""
    schema: dict = {"type": "string"}
    for _ in range(depth):
        name = "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=8))
        schema = {"type": "object", "properties": {name: schema, "n": {"type": "integer"}}, "required": [name]}
    return schema


def _body(kind: str, rng: random.Random, args, byte_ids: list[int]) -> tuple[str, dict]:
    """(path, body) of one hostile request of ``kind``."""
    if kind == "utf8":  # an emoji's first byte and bytes that cannot follow it: never a character
        return "/v1/completions", {"prompt": "Write an emoji:", "max_tokens": args.max_tokens, "stream": True,
                                   "ignore_eos": True, "temperature": 1.0, "seed": rng.randrange(1 << 30),
                                   "logit_bias": {str(i): 100 for i in byte_ids}}
    user = [{"role": "user", "content": "Call f many times."}]
    if kind == "tools":
        calls = f"({CALL_REGEX}){{{max(1, args.max_tokens // 48)}}}"
        return "/v1/chat/completions", {"messages": user, "tools": TOOLS, "guided_regex": calls,
                                        "max_tokens": args.max_tokens, "stream": True}
    schema = _fresh_schema(rng, args.schema_depth)
    return "/v1/chat/completions", {"messages": user, "max_tokens": 32, "response_format": {
        "type": "json_schema", "json_schema": {"name": "fresh", "schema": schema}}}


def _one(address: str, kind: str, rng: random.Random, args, byte_ids: list[int]) -> tuple[str, object, int]:
    """One request of ``kind``, read to its end: (kind, HTTP status or error, bytes received)."""
    path, body = _body(kind, rng, args, byte_ids)
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=900)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return kind, resp.status, len(resp.read())
    except OSError as exc:
        return kind, type(exc).__name__, 0
    finally:
        conn.close()


def _client(address: str, kind: str, seed: int, deadline: float, args, byte_ids: list[int], out) -> None:
    """Requests of ``kind`` back to back until ``deadline``, each outcome put on ``out``."""
    rng = random.Random(seed)
    while time.time() < deadline:
        out.put(_one(address, kind, rng, args, byte_ids))


def _clients(address: str, clients: int, deadline: float, args, byte_ids: list[int], out) -> None:
    """The clients, as threads of their own process (their work never delays /health's poller)."""
    threads = [threading.Thread(target=_client, args=(address, ("utf8", "tools", "schema")[i % 3], i, deadline,
                                                      args, byte_ids, out)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _lag_buckets(host: str, port: int) -> dict[float, float]:
    """The router's loop-lag histogram now: bucket bound -> cumulative count."""
    conn = http.client.HTTPConnection(host, port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    buckets = {}
    for line in text.splitlines():
        if line.startswith(LOOP_LAG + "_bucket{"):
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            buckets[float(bound)] = float(line.rsplit(" ", 1)[1])
    return buckets


def _lag_summary(before: dict[float, float], after: dict[float, float]) -> dict:
    """p99 and max of the lags observed between two scrapes, as bucket upper bounds (seconds)."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts:  # a router without the metric (before issue 41)
        return {"probes": 0, "p99_le_s": None, "max_le_s": None, "over_50ms": None}
    total = counts[-1]
    p99 = next((b for b, c in zip(bounds, counts) if c >= 0.99 * total), None)
    top = next((b for b, c in zip(bounds, counts) if c >= total), None)
    over = total - next((c for b, c in zip(bounds, counts) if b >= 0.05), total)
    return {"probes": int(total), "p99_le_s": p99, "max_le_s": top, "over_50ms": int(over)}


def hostile(args) -> None:
    sys.path.insert(0, str(ROOT))
    from benchmarks.serving_procs import ServerProcess

    out_dir = ROOT / ".bench" / "health_under_flood"
    cmd = [str(Path(sys.executable).parent / "pdserve"), "serve", "--grpc-port", str(args.grpc_port),
           "--port", str(args.port), "--tool-call-parser", "hermes"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    byte_ids = _byte_token_ids()
    host, address = "127.0.0.1", f"127.0.0.1:{args.port}"
    with ServerProcess("pdserve", cmd, env, host, [args.port, args.grpc_port], out_dir / "server.log") as cluster:
        print(f"[hostile] starting the cluster ({' '.join(cmd)}); log: {cluster.log}", flush=True)
        cluster.wait_healthy(1800, lambda _: None)
        warm = [_one(address, kind, random.Random(-1), args, byte_ids) for kind in ("utf8", "tools", "schema")]
        print(f"[hostile] warm-up, unmeasured (kind, status, bytes): {warm}", flush=True)
        print(f"[hostile] {args.clients} clients for {args.duration:.0f} s", flush=True)
        results = _measure(host, address, args, byte_ids)
    print(json.dumps(results))


def _measure(host: str, address: str, args, byte_ids: list[int]) -> dict:
    """Run the clients for ``args.duration`` while polling /health; the figures of the run."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    before = _lag_buckets(host, args.port)
    load = ctx.Process(target=_clients, args=(address, args.clients, time.time() + args.duration, args, byte_ids, out))
    load.start()
    latencies, outcomes = [], []
    while load.is_alive() or not out.empty():
        start = time.monotonic()
        _request(address, "GET", "/health")
        latencies.append(time.monotonic() - start)
        while not out.empty():  # drained as it goes: a full pipe would keep the clients' process alive
            outcomes.append(out.get())
        time.sleep(0.02)
    load.join()
    lag = _lag_summary(before, _lag_buckets(host, args.port))
    requests: dict[str, dict] = {}
    for kind, status, size in outcomes:
        counts = requests.setdefault(kind, {"requests": 0, "statuses": {}, "bytes": 0})
        counts["requests"] += 1
        counts["statuses"][str(status)] = counts["statuses"].get(str(status), 0) + 1
        counts["bytes"] += size
    p99 = statistics.quantiles(latencies, n=100)[98] if len(latencies) >= 2 else latencies[0]
    return {"clients": args.clients, "duration_s": args.duration, "requests": requests,
            "health_polls": len(latencies), "health_p50_ms": round(1000 * statistics.median(latencies), 1),
            "health_p99_ms": round(1000 * p99, 1), "health_max_ms": round(1000 * max(latencies), 1),
            "loop_lag": lag, "targets": {"health_p99_under_100ms": p99 < 0.1,
                                         "loop_lag_under_50ms": lag["max_le_s"] is not None and lag["max_le_s"] <= 0.05}}

if __name__ == "__main__":
    main()
