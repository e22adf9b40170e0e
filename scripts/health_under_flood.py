"""How long ``GET /health`` takes while anonymous clients flood ``/detokenize`` (issue 25).

Starts a real router in a process of its own (the default model's tokenizer, no workers:
/health answers 503, which measures the event loop just as well), sends ``--clients``
concurrent bodies of ``--mb`` MB of token ids from this process, and polls /health every
20 ms until the flood is answered. Prints the /health latencies (max, p50) and how long the
flood took.

    .venv/bin/python scripts/health_under_flood.py --clients 20 --mb 3.8
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import statistics
import subprocess
import sys
import threading
import time


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
    args = parser.parse_args()
    if args.serve:
        return serve()
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


if __name__ == "__main__":
    main()
