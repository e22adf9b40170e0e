"""Interference: what long prompts arriving do to the inter-token latency of running streams,
disaggregated (1 prefill + 1 decode worker, each pinned to a core of its own) against
colocated (one worker pinned to the same two cores, 2 threads), in one run.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/interference.py [--out interference.json]

Per mode: start the cluster, warm it up, start ``--streams`` steady greedy streams (short
prompts, long outputs); once every one is decoding, send ``--long-prompts`` prompts of
``--long-tokens`` tokens, one every ``--gap-s`` seconds; when the last has its first token,
stop the streams. The inter-token latencies of the steady streams from the first long prompt
on (the window where interference can happen) give p50 / p99; the long prompts' TTFT is
reported too. Prints the ratios disaggregated / colocated and writes everything as JSON.

Why one colocated worker with 2 threads and not 2 workers of 1: that is what the same two
cores serve as without disaggregation (vLLM and SGLang run one engine over the machine's
compute), and it gives colocated prefill both cores. Two colocated workers would halve each
long prompt's victims but also double its prefill time; the issue's comparison is one engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.pd_modes import (Stream, load_average, percentile, pinned_cores, random_prompt,  # noqa: E402
                                 run_stream, start, stub_for)
from pdserve.cluster.mode import COLOCATED, DISAGGREGATED  # noqa: E402

ARMS = {DISAGGREGATED: dict(mode=DISAGGREGATED, num_prefill=1, num_decode=1, threads=1),
        COLOCATED: dict(mode=COLOCATED, num_prefill=0, num_decode=1, threads=2)}


async def measure(cluster, args, bar) -> dict:
    channel, stub = stub_for(cluster)
    async with channel:
        # Warm-up: the kernels, and a long prompt through the prefill path (other seeds: no prefix hit).
        await run_stream(stub, random_prompt(args.stream_prompt, 999), 4, Stream(args.stream_prompt))
        await run_stream(stub, random_prompt(args.long_tokens, 998), 2, Stream(args.long_tokens))
        stop = asyncio.Event()
        steady = [Stream(args.stream_prompt) for _ in range(args.streams)]
        tasks = [asyncio.ensure_future(run_stream(stub, random_prompt(args.stream_prompt, i), args.stream_max_tokens,
                                                  s, stop)) for i, s in enumerate(steady)]
        while any(s.tokens < 3 for s in steady):
            await asyncio.sleep(0.05)
        window_start = time.monotonic()
        longs = [Stream(args.long_tokens) for _ in range(args.long_prompts)]
        sent = []
        for i, rec in enumerate(longs):
            sent.append(asyncio.ensure_future(run_stream(stub, random_prompt(args.long_tokens, 100 + i), 2, rec)))
            bar.update(1)
            if i + 1 < len(longs):
                await asyncio.sleep(args.gap_s)
        await asyncio.gather(*sent)
        await asyncio.sleep(args.tail_s)  # the streams recover; their gaps still count
        window_end = time.monotonic()
        stop.set()
        await asyncio.gather(*tasks)
    itls = [b - a for s in steady for a, b in zip(s.times, s.times[1:]) if a >= window_start and b <= window_end]
    errors = [s.error for s in steady + longs if s.error]
    return {"itl_p50_s": percentile(itls, 50), "itl_p99_s": percentile(itls, 99), "itl_max_s": max(itls, default=None),
            "itl_count": len(itls), "steady_tokens": sum(s.tokens for s in steady),
            "long_ttft_s": [round(s.ttft, 3) for s in longs if s.ttft is not None],
            "window_s": round(window_end - window_start, 2), "errors": errors}


def main() -> None:
    from benchmarks.processor import print_banner

    print_banner()  # the processor and kernel path every figure below ran on
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=6, help="steady decode streams")
    ap.add_argument("--stream-prompt", type=int, default=64, help="prompt tokens of a steady stream")
    ap.add_argument("--stream-max-tokens", type=int, default=4000, help="a steady stream's cap (it is stopped first)")
    ap.add_argument("--long-prompts", type=int, default=3)
    ap.add_argument("--long-tokens", type=int, default=1500)
    ap.add_argument("--gap-s", type=float, default=4.0, help="seconds between two long prompts")
    ap.add_argument("--tail-s", type=float, default=1.0, help="window kept after the last long prompt's first token")
    ap.add_argument("--dtype", default=None, help="default: the engine's (bfloat16)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048, help="step token budget, both modes")
    ap.add_argument("--colocated-chunk", type=int, default=512,
                    help="also run colocated with this smaller step budget (prompt chunk), as vLLM's chunked "
                         "prefill would; 0: skip that arm")
    ap.add_argument("--out", type=Path, default=Path("interference.json"))
    args = ap.parse_args()
    arms = {name: {**arm, "budget": args.max_num_batched_tokens} for name, arm in ARMS.items()}
    if args.colocated_chunk:
        arms[f"{COLOCATED}-{args.colocated_chunk}"] = {**ARMS[COLOCATED], "budget": args.colocated_chunk}
    doc = {"args": {k: str(v) for k, v in vars(args).items()}, "load_average_before": load_average(), "modes": {}}
    with tqdm(total=len(arms) * args.long_prompts, desc="long prompts sent", unit="prompt") as bar:
        for mode, arm in arms.items():
            bar.set_postfix_str(f"{mode}: starting")
            cluster = start(arm["mode"], arm["num_prefill"], arm["num_decode"], arm["threads"], args.dtype,
                            arm["budget"])
            try:
                bar.set_postfix_str(mode)
                result = asyncio.run(measure(cluster, args, bar))
                result["workers"] = {**arm, "cores": pinned_cores(cluster)}
            finally:
                cluster.stop()
            doc["modes"][mode] = result
    doc["load_average_after"] = load_average()
    d = doc["modes"][DISAGGREGATED]
    doc["ratios"] = {other: {k: (d[k] / r[k] if d[k] and r[k] else None) for k in ("itl_p50_s", "itl_p99_s")}
                     for other, r in doc["modes"].items() if other != DISAGGREGATED}
    args.out.write_text(json.dumps(doc, indent=2))
    print(f"{'mode':15} {'budget':>6} {'ITL p50 ms':>11} {'ITL p99 ms':>11} {'ITL max ms':>11} {'gaps':>6}  long TTFT s   cores")
    for mode, r in doc["modes"].items():
        print(f"{mode:15} {r['workers']['budget']:6d} {r['itl_p50_s'] * 1e3:11.1f} {r['itl_p99_s'] * 1e3:11.1f} {r['itl_max_s'] * 1e3:11.1f} "
              f"{r['itl_count']:6d}  {r['long_ttft_s']}  {r['workers']['cores']}")
    for other, ratio in doc["ratios"].items():
        print(f"disaggregated / {other}: ITL p50 {ratio['itl_p50_s']:.2f}, ITL p99 {ratio['itl_p99_s']:.2f} "
              f"(target p99 <= 0.5)")
    print(f"load average {doc['load_average_before']} -> {doc['load_average_after']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
