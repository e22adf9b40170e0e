"""Speculative decoding served (issue 57): the same cluster without and with
``--speculative-config``, driven by the project's load generator (benchmarks/load), ratios
printed in the same run.

    .venv/bin/python benchmarks/spec_decode.py                                  # ~12 min on 2 cores
    .venv/bin/python benchmarks/spec_decode.py --spec '{"method": "ngram", "num_speculative_tokens": 4}'
    .venv/bin/python benchmarks/spec_decode.py --rates "" --rounds 1                # c=1 only, ~3 min

Two clusters run side by side, one per configuration (off, and ``--spec``): each a router, a
prefill and a decode worker as plain ``pdserve worker`` processes on loopback
(benchmarks/gpu_bench/served.py's ``start_cluster``), the default model, one torch thread per
worker, every worker given the same flags (``--speculative-config`` reaches only the decode
worker's engine: a prefill worker never speculates). Only one of them has work at a time, and
the two take turns request by request (c=1) or rate by rate (goodput), the order swapped each
time, so load from outside the benchmark (a shared machine) falls on both alike. Then:

1. Concurrency 1 on a repetitive set (``prompts()``): code edits (a function, then "rewrite it
   with X renamed", the answer's code block opened) and summaries asked to quote their text, the
   set sent ``--rounds`` times, greedy, up to ``--max-tokens`` (the answer ends at EOS as a
   client's would). TPOT p50 and p90, and the decode worker's speculation counters over the run
   (its ``Stats``, WorkerStats fields 48-52): acceptance rate = accepted / draft tokens, mean
   accepted length = 1 + accepted / drafts.
2. Goodput: the serving sweep's workload (random prompts of 256 tokens, 64 out, ``ignore_eos``)
   at each rate of ``--rates`` (Poisson, ``--goodput-prompts`` each, seeds per rate as
   benchmarks/goodput.py's, the same prompts on both) under the headline's SLO (TTFT <= 2 s, TPOT
   <= 100 ms): goodput by the sweep's rule (benchmarks/serving_sweep_report.py): the highest rate
   at which 90% meet it and at every lower rate, with the interpolated crossing beside it.

Ratios: TPOT p50 off / on at c=1 (issue 57 asks >= 1.5 on the repetitive set), goodput on / off
(asks >= 1). Writes --out-dir/spec_decode.json (machine, git, the commands, every run's summary,
the counters, ratios) and the workers' logs; prints the table BENCHMARKS.md records.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import processor  # noqa: E402
from benchmarks.goodput import RATE_SEED_STRIDE  # noqa: E402
from benchmarks.gpu_bench.served import members, router_healthy, start_cluster, wait_until  # noqa: E402
from benchmarks.load import SLO, Arrivals, Lengths, Request, WorkloadSpec, run, summarize  # noqa: E402
from benchmarks.serving_run import git_state  # noqa: E402
from benchmarks.serving_sweep_report import goodput as sweep_goodput  # noqa: E402

DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'
HEADLINE_SLO = SLO(ttft_ms=2000.0, tpot_ms=100.0)  # BENCHMARKS.md's goodput objective (issue 45)

FUNCTIONS = {
    "total_price": '''def total_price(items, tax_rate):
    total = 0.0
    for item in items:
        if item.quantity <= 0:
            continue
        total = total + item.price * item.quantity
    total = total * (1.0 + tax_rate)
    return round(total, 2)''',
    "word_counts": '''def word_counts(text):
    counts = {}
    for word in text.lower().split():
        word = word.strip(".,;:!?")
        if not word:
            continue
        counts[word] = counts.get(word, 0) + 1
    return sorted(counts.items(), key=lambda pair: pair[1], reverse=True)''',
    "moving_average": '''def moving_average(values, window):
    result = []
    running = 0.0
    for index, value in enumerate(values):
        running = running + value
        if index >= window:
            running = running - values[index - window]
        if index >= window - 1:
            result.append(running / window)
    return result''',
    "merge_intervals": '''def merge_intervals(intervals):
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged''',
}
RENAMES = {"total_price": ("total", "subtotal"), "word_counts": ("counts", "frequency"),
           "moving_average": ("running", "window_sum"), "merge_intervals": ("merged", "result")}
TEXTS = [
    "The city council met on Tuesday to discuss the new bicycle lanes on Main Street. The council voted "
    "five to two to extend the lanes to the river bridge. The mayor said the lanes would be finished before "
    "the summer. Shop owners on Main Street asked for more parking during the work.",
    "The library will open a new reading room on the second floor next month. The reading room will have "
    "forty seats, quiet study tables and a small collection of local history books. The library will stay "
    "open until nine in the evening on weekdays while the reading room is new.",
    "The school garden produced more vegetables this year than ever before. Students grew tomatoes, beans "
    "and squash, and the kitchen used the vegetables in school lunches. The teachers want to double the size "
    "of the garden next spring so that every class can have its own bed.",
    "The harbor will close for repairs from the first of March to the end of April. Boats will use the north "
    "pier while the harbor is closed. The repairs will replace the old wooden dock with a concrete dock that "
    "can hold larger boats.",
]


def prompts() -> list[str]:
    """The repetitive set: each function to rewrite with a name changed (the answer's code block
    opened, as a user's assistant would start it), and each text to summarize quoting it."""
    out = []
    for name, code in FUNCTIONS.items():
        old, new = RENAMES[name]
        out.append(f"Here is a Python function:\n\n```python\n{code}\n```\n\nRewrite the function with the variable "
                   f"`{old}` renamed to `{new}`. Change nothing else.\n\n```python\n")
    for text in TEXTS:
        out.append(f"Text: {text}\n\nSummarize the text in two sentences, quoting its most important sentences "
                   f"word for word.\n\nSummary: \"")
    return out


def spec_counters(address: str) -> dict:
    """The decode worker's speculation counters (WorkerStats fields 48-52)."""
    import grpc

    from pdserve.protos import worker_pb2, worker_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        s = worker_pb2_grpc.DecodeWorkerStub(ch).Stats(worker_pb2.StatsRequest(), timeout=10)
    return {"k": s.spec_num_speculative_tokens, "drafts": s.spec_num_drafts, "draft_tokens": s.spec_num_draft_tokens,
            "accepted": s.spec_num_accepted_tokens, "accepted_per_pos": list(s.spec_accepted_per_pos)}


def spec_rates(before: dict, after: dict) -> dict:
    moved = {key: after[key] - before[key] for key in ("drafts", "draft_tokens", "accepted")}
    return {**moved, "acceptance_rate": moved["accepted"] / moved["draft_tokens"] if moved["draft_tokens"] else None,
            "mean_accepted_length": 1 + moved["accepted"] / moved["drafts"] if moved["drafts"] else None}


def summary(records: list, duration_s: float, slo: SLO | None = None) -> dict:
    s = asdict(summarize(records, duration_s, slo))
    errors = sorted({r.error for r in records if r.error})[:3]
    return {**{k: s[k] for k in ("completed", "failed", "duration_s", "req_s", "output_tok_s", "ttft_ms", "tpot_ms",
                                 "goodput_req_s", "slo_attainment")}, "errors": errors,
            "output_tokens": sum(r.output_tokens for r in records if r.ok)}


class Cluster:
    """One configuration's three processes, once they serve."""

    def __init__(self, label: str, flags: list[str], args, logs: Path):
        self.label, self.flags = label, flags
        self.procs, self.http_port, self.admin = start_cluster(args.model, flags, logs, label)

    def wait(self) -> None:
        wait_until(lambda: router_healthy(self.http_port) and members(self.admin) == 2,
                   f"the {self.label} workers to join their router", self.procs)
        self.base_url, self.decode = f"http://127.0.0.1:{self.http_port}", self.procs[2].address
        warm = WorkloadSpec(num_requests=2, arrivals=Arrivals("closed", concurrency=1), prompt_len=Lengths.fixed(64),
                            output_len=Lengths.fixed(16), warmup=0, seed=99)
        run(warm, self.base_url, progress=False)  # a fresh worker's first requests are slower

    def stop(self) -> None:
        for p in self.procs[::-1]:
            p.stop()
        for p in self.procs[::-1]:
            p.wait(30)


def repetitive(clusters: list[Cluster], max_tokens: int, rounds: int) -> dict:
    """The set one request at a time, each prompt to both clusters in turn (the order swapped
    every prompt): load from outside the benchmark falls on both alike."""
    spec = WorkloadSpec(num_requests=1, arrivals=Arrivals("closed", concurrency=1), ignore_eos=False, warmup=0,
                        request_timeout_s=300.0)
    before = {c.label: spec_counters(c.decode) for c in clusters}
    records: dict[str, list] = {c.label: [] for c in clusters}
    spent = dict.fromkeys(records, 0.0)
    for i, prompt in enumerate(p for _ in range(rounds) for p in prompts()):
        for c in clusters if i % 2 == 0 else clusters[::-1]:
            results = run(spec, c.base_url, progress=False, requests=[Request(prompt, max_tokens)])
            records[c.label] += results.records
            spent[c.label] += results.summary.duration_s
    return {c.label: {**summary(records[c.label], spent[c.label]),
                      "spec": spec_rates(before[c.label], spec_counters(c.decode))} for c in clusters}


def goodput(clusters: list[Cluster], rates: list[float], n: int, seed: int) -> dict:
    """Each rate on each cluster in turn (the other idle), the same prompts on both."""
    rows: dict[str, list] = {c.label: [] for c in clusters}
    for i, rate in enumerate(rates):
        spec = WorkloadSpec(num_requests=n, arrivals=Arrivals("poisson", rate=rate), prompt_len=Lengths.fixed(256),
                            output_len=Lengths.fixed(64), slo=HEADLINE_SLO, warmup=0,
                            seed=seed + RATE_SEED_STRIDE * (i + 1), request_timeout_s=120.0)
        for c in clusters if i % 2 == 0 else clusters[::-1]:
            before = spec_counters(c.decode)
            results = run(spec, c.base_url, progress=False)
            row = {"rate": rate, **summary(list(results.records), results.summary.duration_s, HEADLINE_SLO),
                   "spec": spec_rates(before, spec_counters(c.decode))}
            rows[c.label].append(row)
            print(f"    {c.label} rate {rate:g}: attainment {row['slo_attainment']:.2f}, TTFT p90 "
                  f"{row['ttft_ms'].get('p90', float('nan')):.0f} ms, TPOT p50 "
                  f"{row['tpot_ms'].get('p50', float('nan')):.1f} ms", flush=True)
    out = {}
    for label, runs in rows.items():  # the sweep's rule: a rate that misses ends the search
        found = sweep_goodput([{"rate": row["rate"], "attainment": row["slo_attainment"]} for row in runs])
        out[label] = {"rows": runs, "goodput_req_s": found["req_s"], "interpolated_req_s": found["interpolated_req_s"],
                      "how": found["how"]}
    return out


def measure(configs: list[tuple[str, list[str]]], args, logs: Path) -> dict:
    """Both configurations' clusters at once, measured in turn; stopped whatever happens."""
    clusters: list[Cluster] = []
    try:
        for label, flags in configs:
            clusters.append(Cluster(label, flags, args, logs))
        for c in clusters:
            c.wait()
        runs = {c.label: {"flags": c.flags} for c in clusters}
        print("  c=1 on the repetitive set ...", flush=True)
        for label, result in repetitive(clusters, args.max_tokens, args.rounds).items():
            runs[label]["repetitive"] = result
        if args.rates:
            print("  goodput sweep ...", flush=True)
            for label, result in goodput(clusters, args.rates, args.goodput_prompts, args.seed).items():
                runs[label]["goodput"] = result
        return runs
    finally:
        for c in clusters:
            c.stop()


def ratios(off: dict, on: dict) -> dict:
    def p50(side):
        return side["repetitive"]["tpot_ms"].get("p50")

    out = {"tpot_p50_off_over_on": p50(off) / p50(on) if p50(off) and p50(on) else None}
    if "goodput" in off and "goodput" in on:
        g_off, g_on = off["goodput"]["goodput_req_s"], on["goodput"]["goodput_req_s"]
        out["goodput_on_over_off"] = g_on / g_off if g_off else None
    return out


def table(doc: dict) -> str:
    lines = ["| | TPOT p50 c=1 (ms) | TPOT p90 | output tokens | acceptance rate | mean accepted length | goodput (req/s) |",
             "|---|---|---|---|---|---|---|"]
    for label in ("off", "on"):
        side = doc["runs"][label]
        rep, spec = side["repetitive"], side["repetitive"]["spec"]
        rate = f"{spec['acceptance_rate']:.2f}" if spec["acceptance_rate"] is not None else "-"
        length = f"{spec['mean_accepted_length']:.2f}" if spec["mean_accepted_length"] is not None else "-"
        good = "-"
        if "goodput" in side:
            crossing = side["goodput"]["interpolated_req_s"]
            good = f"{side['goodput']['goodput_req_s']:g}" + (f" (crossing {crossing:g})" if crossing else "")
        lines.append(f"| {label} | {rep['tpot_ms'].get('p50', float('nan')):.1f} | "
                     f"{rep['tpot_ms'].get('p90', float('nan')):.1f} | {rep['output_tokens']} | {rate} | {length} | "
                     f"{good} |")
    r = doc["ratios"]
    tpot = f"{r['tpot_p50_off_over_on']:.2f}x" if r.get("tpot_p50_off_over_on") else "-"
    good = f"{r['goodput_on_over_off']:.2f}x" if r.get("goodput_on_over_off") else "-"
    lines.append(f"\nTPOT p50 at c=1, off / on: {tpot} (issue 57: >= 1.5x); goodput on / off: {good} (>= 1.00x)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--spec", default=DEFAULT_SPEC, help="the --speculative-config of the 'on' run")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2, help="times the repetitive set is sent (one at a time)")
    ap.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",") if x], default=[0.5, 1.0, 1.5, 2.0],
                    help="goodput sweep's Poisson rates (empty: skip it)")
    ap.add_argument("--goodput-prompts", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", type=Path, default=ROOT / ".bench" / "spec_decode")
    args = ap.parse_args(argv)
    machine = processor.print_banner()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    common = ["--threads-per-worker", "1"]
    doc = {"schema": "pdserve-spec-decode/1", "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "git": git_state(), "machine": machine, "loadavg_before": os.getloadavg(), "spec": args.spec,
           "argv": sys.argv[1:], "runs": {}}
    doc["runs"] = measure([("off", common), ("on", [*common, "--speculative-config", args.spec])], args, args.out_dir)
    doc["loadavg_after"] = os.getloadavg()
    doc["ratios"] = ratios(doc["runs"]["off"], doc["runs"]["on"])
    (args.out_dir / "spec_decode.json").write_text(json.dumps(doc, indent=2) + "\n")
    print("\n" + table(doc))


if __name__ == "__main__":
    main()
