"""The KV tier below the prefix cache, served (issue 58's must-show): a prefix working set four
times a worker's KV memory, revisited, with the tier against without, in one run.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/kv_tier.py            # 16 prefixes of 2,048 tokens
    PYTHONPATH=$PWD .venv/bin/python benchmarks/kv_tier.py --prefixes 8 --revisits 1   # quicker
    PYTHONPATH=$PWD .venv/bin/python benchmarks/kv_tier.py --worker-flags "--max-num-batched-tokens 512"

Two clusters run side by side, one per configuration: each a router, a prefill and a decode
worker as plain ``pdserve worker`` processes on loopback (benchmarks/gpu_bench/served.py's
``start_cluster``, no Ray), the default model in bfloat16, one torch thread per worker. Both
get the same ``--kv-cache-memory``: the working set (``--prefixes`` x ``--prefix-tokens`` tokens
of KV) divided by ``--working-set-ratio`` (4), so one worker's KV memory holds a quarter of
it. The "tier" cluster adds ``--kv-offload-bytes`` (room for the whole working set, twice
over) and ``--kv-offload-dir`` (a fresh directory under ``--tier-root``, default the system's
temporary directory, the tier's own default place on a CPU host), shared by its two workers.

Traffic: ``--prefixes`` distinct prefixes (random token ids, a document or a system prompt),
each followed by a short question of its own (``--question-tokens`` random ids, new on every
request), ``--output-tokens`` generated (``ignore_eos``). First the cold pass: every prefix
once. Then ``--revisits`` passes over the prefixes, each in a shuffled order. Requests go one
at a time, each to both clusters in turn, the order swapped every request, so that load from
outside the benchmark (a machine shared with other work) falls on both alike.

Per configuration, on the revisits: the share of prompt tokens served from cache (the
router's ``usage.cached_prompt_tokens`` over ``usage.prompt_tokens``; at most
prefix / (prefix + question) since a question is never cached) and TTFT p50 and p90 (send to
the first streamed token, gRPC). The tier's counters from both workers' ``Stats`` (WorkerStats
fields 55-61). Ratios: TTFT p50 without / with (issue 58 asks >= 2x) and the cached share with
the tier (asks >= 80%). Writes --out-dir/kv_tier.json and the workers' logs.

On a loaded machine a 2,048-token prefill step can outlast the router's hang timeout, and the
router then has the decode worker prefill that request (its log says so); smaller prefill
chunks (the last command above) keep every request on the disaggregated path.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import processor  # noqa: E402
from benchmarks.gpu_bench.served import members, router_healthy, start_cluster, wait_until  # noqa: E402
from benchmarks.load.metrics import percentile  # noqa: E402
from benchmarks.serving_run import git_state  # noqa: E402
from pdserve.protos import pdserve_pb2, pdserve_pb2_grpc, worker_pb2, worker_pb2_grpc  # noqa: E402

TARGET_CACHED = 0.80  # share of revisit prompt tokens served from cache, with the tier
TARGET_TTFT = 2.0  # TTFT p50 without / with
BLOCK_SIZE = 16  # the workers' default --block-size


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--prefixes", type=int, default=16, help="distinct prefixes in the working set")
    ap.add_argument("--prefix-tokens", type=int, default=2048)
    ap.add_argument("--question-tokens", type=int, default=32)
    ap.add_argument("--output-tokens", type=int, default=8)
    ap.add_argument("--revisits", type=int, default=1, help="shuffled passes over the prefixes after the cold one")
    ap.add_argument("--working-set-ratio", type=float, default=4.0, help="working set / one worker's KV memory")
    ap.add_argument("--tier-root", type=Path, default=Path(tempfile.gettempdir()),
                    help="where the tier's directory is made (a fresh one, removed after)")
    ap.add_argument("--threads-per-worker", type=int, default=1)
    ap.add_argument("--worker-flags", default="", help="more flags for every worker of both clusters (one string), "
                    "e.g. '--max-num-batched-tokens 512' to keep a prefill step under the router's hang timeout")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", type=Path, default=ROOT / ".bench" / "kv_tier")
    args = ap.parse_args(argv)
    for name in ("prefixes", "prefix_tokens", "question_tokens", "output_tokens", "revisits", "threads_per_worker"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if args.working_set_ratio <= 1:
        ap.error(f"--working-set-ratio: must be > 1 (the working set must not fit), got {args.working_set_ratio}")
    return args


def kv_bytes_per_token(model: str, dtype: str) -> int:
    """One token's KV in a worker's cache (every layer, K and V), as the workers lay it out."""
    import torch

    from pdserve.engine.attention.kv_cache import KVCacheSpec
    from pdserve.engine.loader import materialize, read_model_config

    cfg = read_model_config(materialize(model, progress=False))
    return KVCacheSpec.of(cfg, BLOCK_SIZE, getattr(torch, dtype)).bytes_per_token


def sizes(args) -> dict:
    """The working set's bytes, each worker's KV memory (a whole number of blocks) and the tier's bound."""
    per_token = kv_bytes_per_token(args.model, args.dtype)
    working_set = args.prefixes * args.prefix_tokens * per_token
    block = per_token * BLOCK_SIZE
    kv = int(working_set / args.working_set_ratio) // block * block
    need = -(-(args.prefix_tokens + args.question_tokens + args.output_tokens) // BLOCK_SIZE) * block
    if kv < need:
        raise SystemExit(f"--working-set-ratio: {args.working_set_ratio} leaves {kv} bytes of KV memory, under one "
                         f"request's {need}; use more --prefixes or a smaller ratio")
    return {"kv_bytes_per_token": per_token, "working_set_bytes": working_set, "kv_cache_memory": kv,
            "kv_offload_bytes": 2 * working_set}


def traffic(args) -> tuple[list[list[int]], list[int]]:
    """The prefixes, and the order they are sent in: the cold pass, then the shuffled revisits."""
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(1000, 40000) for _ in range(args.prefix_tokens)] for _ in range(args.prefixes)]
    order = list(range(args.prefixes))
    for _ in range(args.revisits):
        again = list(range(args.prefixes))
        rng.shuffle(again)
        order += again
    return prefixes, order


def one(stub, prompt: list[int], output_tokens: int) -> dict:
    """One streamed request: TTFT and the router's usage."""
    req = pdserve_pb2.GenerateRequest(token_ids=pdserve_pb2.TokenIds(ids=prompt),
                                      sampling=pdserve_pb2.SamplingParams(max_tokens=output_tokens, ignore_eos=True))
    sent, first, usage = time.perf_counter(), None, None
    for r in stub.Generate(req, timeout=600):
        if first is None and r.token_ids:
            first = time.perf_counter()
        if r.HasField("usage"):
            usage = r.usage
    if first is None or usage is None:
        raise RuntimeError("the stream ended without a token or without usage")
    return {"ttft_s": first - sent, "prompt_tokens": usage.prompt_tokens, "cached_tokens": usage.cached_prompt_tokens}


def tier_counters(address: str, decode: bool) -> dict:
    """A worker's prefix-cache and tier counters (WorkerStats 14-15 and 55-61), and a prefill
    worker's prompt tokens read from the decode worker's cache instead of computed (34)."""
    with grpc.insecure_channel(address) as ch:
        stub = (worker_pb2_grpc.DecodeWorkerStub if decode else worker_pb2_grpc.PrefillWorkerStub)(ch)
        s = stub.Stats(worker_pb2.StatsRequest(), timeout=10)
    return {"prefix_cache_queries": s.prefix_cache_queries, "prefix_cache_hits": s.prefix_cache_hits,
            "tier_id": s.kv_tier_id, "tier_bytes_used": s.kv_tier_bytes_used,
            "tier_capacity_bytes": s.kv_tier_capacity_bytes, "blocks_offloaded": s.kv_tier_blocks_offloaded,
            "blocks_loaded": s.kv_tier_blocks_loaded, "tier_hit_tokens": s.prefix_cache_tier_hits,
            "corrupt_blocks": s.kv_tier_corrupt_blocks, "prefix_tokens_read": s.prefix_tokens_read}


class Cluster:
    """One configuration's router, prefill and decode worker, once they serve."""

    def __init__(self, label: str, flags: list[str], args, logs: Path):
        self.label, self.flags = label, flags
        self.procs, self.http_port, self.admin = start_cluster(args.model, flags, logs, label.replace(" ", "_"))
        self.records: list[dict] = []

    def wait(self) -> None:
        wait_until(lambda: router_healthy(self.http_port) and members(self.admin) == 2 and self.procs[0].address,
                   f"the {self.label} workers to join their router", self.procs)
        self.channel = grpc.insecure_channel(self.procs[0].address)
        self.stub = pdserve_pb2_grpc.GenerationStub(self.channel)
        one(self.stub, [7, 8, 9, 10] * 8, 2)  # a fresh worker's first request is slower

    def counters(self) -> dict:
        return {"prefill": tier_counters(self.procs[1].address, decode=False),
                "decode": tier_counters(self.procs[2].address, decode=True)}

    def stop(self) -> None:
        if getattr(self, "channel", None):
            self.channel.close()
        for p in self.procs[::-1]:
            p.stop()
        for p in self.procs[::-1]:
            p.wait(30)


def drive(clusters: list[Cluster], prefixes: list[list[int]], order: list[int], args) -> None:
    """Every request of the run, one at a time, to each cluster in turn (the order swapped every
    request); both clusters get the same prompt, its question new on every visit."""
    rng = random.Random(args.seed + 1)
    seen: set[int] = set()
    for i, which in enumerate(tqdm(order, desc="prefix visits (each to both clusters)", unit="visit")):
        prompt = prefixes[which] + [rng.randrange(1000, 40000) for _ in range(args.question_tokens)]
        for c in clusters if i % 2 == 0 else clusters[::-1]:
            rec = one(c.stub, prompt, args.output_tokens)
            c.records.append({"prefix": which, "revisit": which in seen, **rec})
        seen.add(which)


def summary(records: list[dict], prefix_tokens: int) -> dict:
    revisits = [r for r in records if r["revisit"]]
    cold = [r for r in records if not r["revisit"]]
    prompt = sum(r["prompt_tokens"] for r in revisits)
    cached = sum(r["cached_tokens"] for r in revisits)
    ttft = [r["ttft_s"] * 1e3 for r in revisits]
    return {"revisits": len(revisits), "revisit_prompt_tokens": prompt, "revisit_cached_tokens": cached,
            "cached_share": cached / prompt if prompt else None,
            "prefix_cached_share": cached / (len(revisits) * prefix_tokens) if revisits else None,
            "ttft_ms": {"p50": percentile(ttft, 50), "p90": percentile(ttft, 90), "mean": statistics.fmean(ttft)},
            "cold_ttft_ms_p50": percentile([r["ttft_s"] * 1e3 for r in cold], 50)}


def report(doc: dict, counters: bool = True) -> str:
    """The table BENCHMARKS.md records; ``counters``: with the workers' tier counters."""
    head = "| | revisit prompt tokens cached | TTFT p50 revisits (ms) | TTFT p90 | TTFT p50 cold pass |"
    lines = [head + (" tier blocks offloaded / loaded (prefill + decode) | corrupt |" if counters else ""),
             "|---" * (7 if counters else 5) + "|"]
    for label in ("no tier", "tier"):
        s = doc["runs"][label]["summary"]
        row = (f"| {label} | {100 * s['cached_share']:.1f}% | {s['ttft_ms']['p50']:.0f} | "
               f"{s['ttft_ms']['p90']:.0f} | {s['cold_ttft_ms_p50']:.0f} |")
        if counters:
            c = doc["runs"][label]["counters"]
            moved = [sum(c[w][k] for w in ("prefill", "decode")) for k in ("blocks_offloaded", "blocks_loaded")]
            row += f" {moved[0]} / {moved[1]} | {sum(c[w]['corrupt_blocks'] for w in ('prefill', 'decode'))} |"
        lines.append(row)
    r = doc["ratios"]
    lines.append(f"\nTTFT p50 on revisits, no tier / tier: {r['ttft_p50_ratio']:.2f}x (issue 58: >= {TARGET_TTFT:g}x, "
                 f"{'met' if r['ttft_p50_ratio'] >= TARGET_TTFT else 'MISSED'}); revisit prompt tokens cached with the "
                 f"tier: {100 * r['tier_cached_share']:.1f}% (>= {100 * TARGET_CACHED:.0f}%, "
                 f"{'met' if r['tier_cached_share'] >= TARGET_CACHED else 'MISSED'}); without: "
                 f"{100 * r['no_tier_cached_share']:.1f}%")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    machine = processor.print_banner()
    size = sizes(args)
    prefixes, order = traffic(args)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    print(f"working set {size['working_set_bytes'] / 2**20:.0f} MiB ({args.prefixes} x {args.prefix_tokens} tokens), "
          f"KV memory per worker {size['kv_cache_memory'] / 2**20:.0f} MiB, tier bound "
          f"{size['kv_offload_bytes'] / 2**20:.0f} MiB; {len(order)} visits per cluster", flush=True)
    common = ["--threads-per-worker", str(args.threads_per_worker), "--dtype", args.dtype,
              "--kv-cache-memory", str(size["kv_cache_memory"]), *shlex.split(args.worker_flags)]
    doc = {"schema": "pdserve-kv-tier/1", "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "git": git_state(), "machine": machine, "loadavg_before": os.getloadavg(), "argv": sys.argv[1:],
           "sizes": size, "runs": {}}
    clusters: list[Cluster] = []
    args.tier_root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pdserve-kv-tier-bench-", dir=args.tier_root) as tier_dir:
        tier_flags = ["--kv-offload-bytes", str(size["kv_offload_bytes"]), "--kv-offload-dir", tier_dir]
        try:
            for label, flags in (("no tier", common), ("tier", [*common, *tier_flags])):
                clusters.append(Cluster(label, flags, args, args.out_dir))
            for c in clusters:
                c.wait()
            started = time.perf_counter()
            drive(clusters, prefixes, order, args)
            doc["seconds"] = time.perf_counter() - started
            for c in clusters:
                doc["runs"][c.label] = {"flags": c.flags, "summary": summary(c.records, args.prefix_tokens),
                                        "counters": c.counters(), "records": c.records}
        finally:
            for c in clusters:
                c.stop()
    doc["loadavg_after"] = os.getloadavg()
    off, on = doc["runs"]["no tier"]["summary"], doc["runs"]["tier"]["summary"]
    doc["ratios"] = {"ttft_p50_ratio": off["ttft_ms"]["p50"] / on["ttft_ms"]["p50"],
                     "tier_cached_share": on["cached_share"], "no_tier_cached_share": off["cached_share"]}
    (args.out_dir / "kv_tier.json").write_text(json.dumps(doc, indent=1) + "\n")
    print("\n" + report(doc))
    print(f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC; load average before {doc['loadavg_before'][0]:.1f}, "
          f"after {doc['loadavg_after'][0]:.1f} (a shared machine); {args.prefixes} prefixes x {args.prefix_tokens} "
          f"+ {args.question_tokens} question tokens, {args.output_tokens} out, {args.revisits} revisit pass(es), {args.dtype}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
