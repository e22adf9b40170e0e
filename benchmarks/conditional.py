"""Conditional disaggregation: TTFT and throughput for a mix of short and long prompts, with
and without the local-prefill rule, on the same cluster shape (1 prefill + 1 decode worker,
each pinned to a core of its own), in one run.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/conditional.py [--threshold 512 2048] [--out conditional.json]

The same seeded arrival schedule (Poisson, ``--rate`` requests/s) of ``--requests`` greedy
requests, a ``--long-share`` of them with ``--long-tokens`` prompt tokens and the rest with
``--short-tokens``, each ``--max-tokens`` long, goes to two clusters: the rule off (every
prompt through the prefill pool) and on, once per ``--threshold`` given
(``local_prefill_max_tokens``; ``local_prefill_max_load=--max-load``). Per arm: TTFT p50/p99 of the short and of the long
prompts, ITL p50/p99, output tokens per second over the run's makespan, and the router's
decision counts (its /metrics). Prints rule-on / rule-off ratios and writes JSON.

Where the rule pays on this machine: short prompts no longer queue behind long ones on the
prefill worker; they run in a mixed step on the decode worker instead, which costs that
worker's streams one step's worth of prompt tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
import urllib.request
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.pd_modes import (Stream, load_average, percentile, pinned_cores, random_prompt,  # noqa: E402
                                 run_stream, start, stub_for)
from pdserve.cluster.mode import DISAGGREGATED  # noqa: E402
from pdserve.router.local_prefill import LocalPrefillConfig  # noqa: E402
from pdserve.router.limits import RouterLimits  # noqa: E402


def schedule(args) -> list[tuple[float, int, int]]:
    """(send time s, prompt tokens, prompt seed) for every request: the same for both arms."""
    rng = random.Random(args.seed)
    t, out = 0.0, []
    for i in range(args.requests):
        t += rng.expovariate(args.rate)
        out.append((t, args.long_tokens if rng.random() < args.long_share else args.short_tokens, 1000 + i))
    return out


async def drive(cluster, args, plan, bar) -> list[Stream]:
    channel, stub = stub_for(cluster)
    async with channel:
        await run_stream(stub, random_prompt(args.short_tokens, 7), 4, Stream(args.short_tokens))  # warm-up
        await run_stream(stub, random_prompt(args.long_tokens, 8), 2, Stream(args.long_tokens))
        start_at = time.monotonic()
        records = [Stream(n) for _, n, _ in plan]

        async def one(at: float, n: int, seed: int, rec: Stream) -> None:
            await asyncio.sleep(max(0.0, start_at + at - time.monotonic()))
            await run_stream(stub, random_prompt(n, seed), args.max_tokens, rec)
            bar.update(1)

        await asyncio.gather(*(one(at, n, seed, rec) for (at, n, seed), rec in zip(plan, records)))
    return records


def decisions(http_address: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{http_address}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("pdserve:local_prefill_decisions_total{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.split("{", 1)[1].rstrip("}")] = float(value)
    return out


def summarize(records: list[Stream], args) -> dict:
    def ttfts(n):
        return [r.ttft for r in records if r.prompt_tokens == n and r.ttft is not None]

    itls = [x for r in records for x in r.itls()]
    first = min(r.sent_at for r in records)
    last = max(r.times[-1] for r in records if r.times)
    tokens = sum(r.tokens for r in records)
    return {"short_ttft_p50_s": percentile(ttfts(args.short_tokens), 50),
            "short_ttft_p99_s": percentile(ttfts(args.short_tokens), 99),
            "long_ttft_p50_s": percentile(ttfts(args.long_tokens), 50),
            "long_ttft_p99_s": percentile(ttfts(args.long_tokens), 99),
            "itl_p50_s": percentile(itls, 50), "itl_p99_s": percentile(itls, 99),
            "output_tokens_per_s": tokens / (last - first), "makespan_s": last - first,
            "requests": len(records), "long_requests": len(ttfts(args.long_tokens)),
            "errors": [r.error for r in records if r.error]}


def main() -> None:
    from benchmarks.processor import print_banner

    print_banner()  # the processor and kernel path every figure below ran on
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rate", type=float, default=1.0, help="requests per second (Poisson)")
    ap.add_argument("--short-tokens", type=int, default=96)
    ap.add_argument("--long-tokens", type=int, default=1536)
    ap.add_argument("--long-share", type=float, default=0.25)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threshold", type=int, nargs="+", default=[512],
                    help="local_prefill_max_tokens of each rule-on arm")
    ap.add_argument("--max-load", type=float, default=LocalPrefillConfig.max_load, help="local_prefill_max_load")
    ap.add_argument("--dtype", default=None, help="default: the engine's (bfloat16)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("conditional.json"))
    args = ap.parse_args()
    plan = schedule(args)
    arms = {"rule_off": LocalPrefillConfig(),
            **{f"rule_on_{t}": LocalPrefillConfig(max_tokens=t, max_load=args.max_load) for t in args.threshold}}
    doc = {"args": {k: str(v) for k, v in vars(args).items()}, "load_average_before": load_average(), "arms": {}}
    with tqdm(total=len(arms) * len(plan), desc="requests", unit="req") as bar:
        for name, rule in arms.items():
            bar.set_postfix_str(f"{name}: starting")
            cluster = start(DISAGGREGATED, 1, 1, 1, args.dtype, 2048, RouterLimits(local_prefill=rule), http=True)
            try:
                bar.set_postfix_str(name)
                records = asyncio.run(drive(cluster, args, plan, bar))
                result = summarize(records, args)
                result["decisions"] = decisions(cluster.http_address)
                result["cores"] = pinned_cores(cluster)
            finally:
                cluster.stop()
            doc["arms"][name] = result
    doc["load_average_after"] = load_average()
    off = doc["arms"]["rule_off"]
    keys = ("short_ttft_p50_s", "short_ttft_p99_s", "long_ttft_p50_s", "long_ttft_p99_s", "itl_p50_s", "itl_p99_s",
            "output_tokens_per_s")
    ons = [name for name in arms if name != "rule_off"]
    doc["ratios_on_over_off"] = {name: {k: (doc["arms"][name][k] / off[k] if doc["arms"][name][k] and off[k] else None)
                                        for k in keys} for name in ons}
    args.out.write_text(json.dumps(doc, indent=2))
    print(f"{'metric':22} {'rule off':>10}" + "".join(f" {name:>14} {'on/off':>7}" for name in ons))
    for k in keys:
        cells = "".join(f" {doc['arms'][name][k] or 0:14.3f} {doc['ratios_on_over_off'][name][k] or 0:7.2f}"
                        for name in ons)
        print(f"{k:22} {off[k] or 0:10.3f}{cells}")
    for name in ("rule_off", *ons):
        print(f"decisions, {name}: {doc['arms'][name]['decisions']}")
    print(f"load average {doc['load_average_before']} -> {doc['load_average_after']}; wrote {args.out}")


if __name__ == "__main__":
    main()
