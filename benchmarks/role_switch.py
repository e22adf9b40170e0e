"""Role switches under load: how long each takes from the controller's decision to the worker
serving its new role (p50, p99), and what the clients saw through all of them.

An elastic cluster of three workers (two prefill, one decode; the default model in float32, so
that every stream can be checked token for token against an undisturbed run) serves greedy
streams from ``--clients`` clients while one round after another switches workers:

1. the spare prefill worker -> decode, with a grace (its prefill role drains: prompts answered,
   KV pulled);
2. the first decode worker -> prefill with no grace: its streams move with their KV to the spare;
3. it goes back to decode, with a grace;
4. the spare back to prefill with no grace: its streams move with their KV;
5. the decode worker -> mixed and 6. back to decode (the same core stays open: nothing drains).

Prints each kind's switch time (p50, p99, max), the streams moved with their KV and re-prefilled,
the requests completed, failed and differing from the undisturbed run, and the KV blocks and
leases still held once the load is over. ``--out`` writes it as JSON, ``--plot`` each switch's
time by kind.

    .venv/bin/python benchmarks/role_switch.py --rounds 8 --out benchmarks/results/role-switch.json \\
        --plot docs/benchmarks/role-switch.png
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from benchmarks.processor import print_banner  # noqa: E402
from tests.clusters import cluster_config, reconnecting_stub, running_cluster  # noqa: E402
from tests.faults.load import Load  # noqa: E402
from tests.helpers.chat import chat_request, collect  # noqa: E402
from tests.serving.conftest import worker_stats  # noqa: E402

PROMPTS = [f"Tell me a short fact about the number {i}." for i in range(4)]
GRACE_S = 30.0  # the graceful switches': far beyond what a prefill role holds


def router_counters(cluster) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{cluster.http_address}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    names = ("pdserve:request_migrations_total", "pdserve:request_kv_moves_total")
    return {n: sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(n + "{")) for n in names}


def held(cluster, within_s: float = 15.0) -> dict[str, tuple[int, int]]:
    """KV blocks in use and leases held per worker, once they are all zero (or ``within_s`` passed)."""
    deadline = time.monotonic() + within_s
    while True:
        busy = {a: (s.num_blocks_used, s.num_held_leases) for role in ("prefill", "decode")
                for a in cluster.addresses(role) if (s := worker_stats(a, role)).num_blocks_used or s.num_held_leases}
        if not busy or time.monotonic() > deadline:
            return busy
        time.sleep(0.2)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--clients", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--out", type=Path)
    p.add_argument("--plot", type=Path)
    args = p.parse_args()
    info = print_banner()
    config = cluster_config(dtype="float32", num_prefill=2, num_decode=1, elastic_roles=True, lease_seconds=60.0,
                            router_poll_s=0.2)
    switches, start = [], None
    with running_cluster(config) as cluster, reconnecting_stub(cluster.address) as stub:
        reference = [collect(stub.Generate(chat_request(q, args.max_tokens, ignore_eos=True), timeout=120))[0]
                     for q in PROMPTS]
        spare, decode = cluster.prefill_addresses[-1], cluster.decode_addresses[0]
        steps = [(spare, "decode", GRACE_S), (decode, "prefill", 0.0), (decode, "decode", GRACE_S),
                 (spare, "prefill", 0.0), (decode, "mixed", GRACE_S), (decode, "decode", GRACE_S)]
        start = router_counters(cluster)
        with Load(stub, PROMPTS, args.max_tokens, args.clients, 120.0) as load:
            load.wait_for(args.clients)
            for _ in tqdm(range(args.rounds), desc="rounds of switches", unit="round"):
                for address, role, grace_s in steps:
                    time.sleep(0.5)  # streams running on every worker when the switch comes
                    done = cluster.set_role(address, role, grace_s, reason="benchmark")
                    switches.append({"kind": f"{done.previous}->{done.role}" + (" (grace 0)" if not grace_s else ""),
                                     "seconds": done.seconds, "worker_seconds": done.worker_seconds,
                                     "handed_over": done.handed_over, "kv_moved": done.kv_moved})
            load.wait_for(args.clients)
        outcomes = load.outcomes
        counters = {k: v - start[k] for k, v in router_counters(cluster).items()}
        left = held(cluster)
    failed = [(o.code.name, o.details) for o in outcomes if o.code is not None]
    differ = sum(1 for o in outcomes if o.code is None and o.tokens != reference[o.prompt])
    kinds = sorted({s["kind"] for s in switches}, key=lambda k: [s["kind"] for s in switches].index(k))
    print(f"\n{len(switches)} switches under {args.clients} clients' greedy streams ({args.max_tokens} tokens each)\n")
    print("| switch | n | decision -> serving p50 / p99 / max ms | streams handed over (with KV) |")
    print("|---|---|---|---|")
    rows = []
    for kind in kinds + ["all"]:
        sel = [s for s in switches if kind in ("all", s["kind"])]
        t = np.array([s["seconds"] for s in sel]) * 1e3
        row = {"kind": kind, "n": len(sel), "p50_ms": float(np.percentile(t, 50)),
               "p99_ms": float(np.percentile(t, 99)), "max_ms": float(t.max()),
               "handed_over": sum(s["handed_over"] for s in sel),
               "kv_moved": sum(s["kv_moved"] for s in sel)}
        rows.append(row)
        print(f"| {kind} | {row['n']} | {row['p50_ms']:.0f} / {row['p99_ms']:.0f} / {row['max_ms']:.0f} | "
              f"{row['handed_over']} ({row['kv_moved']}) |")
    print(f"\nrequests: {len(outcomes)} completed or failed; failed {len(failed)} {failed[:3]}; "
          f"tokens differing from the undisturbed run: {differ}")
    print(f"router: streams moved with their KV {counters['pdserve:request_kv_moves_total']:.0f}, "
          f"re-prefilled {counters['pdserve:request_migrations_total']:.0f}; KV held after the load: {left or 'none'}")
    if args.out:
        args.out.write_text(json.dumps({"processor": info, "clients": args.clients, "max_tokens": args.max_tokens,
                                        "rounds": args.rounds, "kinds": rows, "switches": switches,
                                        "requests": len(outcomes), "failed": failed, "differing": differ,
                                        "router": counters, "held_after": left}, indent=1) + "\n")
    if args.plot:
        plot(switches, kinds, args.plot, info)
    return 1 if failed or differ or left else 0


def plot(switches: list[dict], kinds: list[str], path: Path, info: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for i, kind in enumerate(kinds):
        t = [s["seconds"] * 1e3 for s in switches if s["kind"] == kind]
        ax.scatter(np.full(len(t), i) + np.linspace(-0.15, 0.15, len(t)), t, s=14)
        ax.hlines(np.percentile(t, 50), i - 0.3, i + 0.3, colors="k", linewidth=1)
    ax.set_xticks(range(len(kinds)), kinds, rotation=15, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("decision -> serving (ms)")
    ax.set_title(f"Role switches under load (line: p50); {info['cpu_model']}, kernel path {info['kernel_path']}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
