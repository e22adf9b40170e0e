"""Calibration: the simulator with this machine's fitted CPU profile against the serving
benchmark's measured TTFT and TPOT percentiles. Target: within 25% of each measured value.

    PYTHONPATH=. .venv/bin/python benchmarks/planner/calibrate.py                 # the recorded sets, current profile
    PYTHONPATH=. .venv/bin/python benchmarks/planner/calibrate.py --reprofile     # re-measure the engine first
    PYTHONPATH=. .venv/bin/python benchmarks/planner/calibrate.py --measured my_run.json other.json
    PYTHONPATH=. .venv/bin/python benchmarks/planner/calibrate.py --measured benchmarks/planner/serving_measured.json \
        --profile benchmarks/planner/calibration/cpu-2026-11-23-1151.json   # the earlier vllm-bench runs
    PYTHONPATH=. .venv/bin/python benchmarks/planner/calibrate.py --points benchmarks/planner/recorded_quiet_points.json

The measured file (written by the serving benchmark, or by hand from its output):

    {"source": "where the numbers come from",
     "runs": [{"name": "float32 1P+1D, 2 req/s",
               "layout": "1P:1D",                         # or "1C" (colocated), as `pdserve plan --layout`
               "workload": {"request_rate": 2.0, "num_prompts": 32, "input_len": 256, "output_len": 64,
                            "seed": 0},
               "measured": {"ttft_ms": {"p50": 10820.2, "p90": 15600.7},
                            "tpot_ms": {"p50": 238.9, "p90": 262.7}}}]}

Arrivals are Poisson at ``request_rate`` (as ``vllm bench serve --request-rate`` sends them),
``num_prompts`` of them, fixed lengths (``--random-range-ratio 0``, ``--ignore-eos``); or, with
``max_concurrency`` instead of ``request_rate``, a closed loop of that many clients (the
simulator's ``closed_loop``). An open-loop served run from ``vllm bench serve`` drew
its arrival times from vLLM's random generator, which this script cannot repeat, and with 32
prompts near saturation one draw of arrival times moves TTFT by tens of percent. So the
simulated value is the mean over ``--seeds`` draws, printed with the 10-90% range of the draws.

``--measure URL`` takes the measured side itself, with the project's load generator against a
running cluster (``pdserve serve``), right after ``--reprofile`` when both are given, so the
profile and the served runs see the machine at the same speed. Each run then records its
requests' send times (``arrivals_s``), and the simulator replays exactly those arrivals: one
simulation, no draws.

    PYTHONPATH=. .venv/bin/python benchmarks/planner/calibrate.py --reprofile \
        --measure http://127.0.0.1:8300 --measured .bench/calibrate/measured.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from planner.cli import parse_layout  # noqa: E402
from planner.cost import CostModel  # noqa: E402
from planner.hardware import DEFAULT_CPU_PROFILE, HardwareProfile  # noqa: E402
from planner.model_spec import PRESETS  # noqa: E402
from planner.profile import Point, fit  # noqa: E402
from planner.simulator import ClusterSpec, Simulator  # noqa: E402
from planner.trace import TraceRequest  # noqa: E402
from planner.worker import EngineLimits  # noqa: E402

TOLERANCE = 0.25


# --measure: the serving benchmark's two loads (random 256-token prompts, 64 output tokens,
# --ignore-eos): 2 req/s with 32 prompts, which saturates one prefill worker, and a closed loop
# of 16 clients with 48 prompts; and 0.5 req/s with 32 prompts, below saturation
MEASURE_LOADS = ({"request_rate": 0.5, "num_prompts": 32}, {"request_rate": 2.0, "num_prompts": 32},
                 {"max_concurrency": 16, "num_prompts": 48})


def measure(base_url: str, seed: int) -> dict:
    """Served runs against the cluster at ``base_url``, with the arrivals each one sent."""
    import time

    from benchmarks.load import Arrivals, Lengths, WorkloadSpec, run
    from benchmarks.load.metrics import tpot, ttft

    runs = []
    for i, load in enumerate(MEASURE_LOADS):
        w = {**load, "input_len": 256, "output_len": 64, "seed": seed + i}
        closed = "max_concurrency" in w
        arrivals = (Arrivals("closed", concurrency=w["max_concurrency"]) if closed
                    else Arrivals("poisson", rate=w["request_rate"]))
        name = f"1P+1D, concurrency {w['max_concurrency']}" if closed else f"1P+1D, {w['request_rate']:g} req/s"
        spec = WorkloadSpec(num_requests=w["num_prompts"], arrivals=arrivals,
                            prompt_len=Lengths.fixed(w["input_len"]), output_len=Lengths.fixed(w["output_len"]),
                            seed=w["seed"])  # a seed per run: no prefix-cache hits from an earlier run
        res = run(spec, base_url)
        if res.summary.failed:
            raise SystemExit(f"calibrate: {res.summary.failed} requests failed in {name}")
        records = sorted(res.records, key=lambda r: r.sent)
        t0 = records[0].sent
        pick = lambda d: {"p50": d["p50"], "p90": d["p90"]}  # noqa: E731
        runs.append({"name": name, "layout": "1P:1D", "workload": w,
                     **({} if closed else {"arrivals_s": [r.sent - t0 for r in records]}),
                     # each request's own times, to set beside the simulated ones
                     "requests_ms": [{"ttft": 1e3 * ttft(r), "tpot": 1e3 * tpot(r)} for r in records],
                     "measured": {"ttft_ms": pick(res.summary.ttft_ms), "tpot_ms": pick(res.summary.tpot_ms)}})
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return {"source": f"benchmarks/planner/calibrate.py --measure {base_url}, {stamp}: the project's load "
                      "generator, random 256-token prompts, 64 output tokens, ignore_eos", "runs": runs}


# The served probe: what serving adds to the engine's own steps, from the token times a client
# sees. Requests at batch 1 (256-token prompts, one at a time) and at batch 16 (short prompts,
# long outputs, so nearly every step of a request runs at the full batch), while a second
# client keeps the prefill worker busy with 256-token prompts (one output token each, so they
# add no decode work), as it is in the loads that saturate it. Between the first token (from
# the prefill worker) and the second (the decode worker's first step) lies the hand-off: the
# router asking the decode worker, the KV read, the sequence joining. Every later gap is one
# served decode step.
PROBE_PROMPT, PROBE_OUTPUT, PROBE_BATCH = 32, 128, 16


def _probe(base_url: str, batch: int, prompt: int, output: int, requests: int, seed: int, busy_decode: bool = False):
    """Records of ``requests`` requests, ``batch`` at a time, the prefill worker kept busy (or,
    with ``busy_decode``, the decode worker: eight short prompts with long answers)."""
    import asyncio

    from benchmarks.load import Arrivals, Lengths, WorkloadSpec, run_async

    probe = WorkloadSpec(num_requests=requests, arrivals=Arrivals("closed", concurrency=batch),
                         prompt_len=Lengths.fixed(prompt), output_len=Lengths.fixed(output), seed=seed)
    busy = (WorkloadSpec(num_requests=10_000, arrivals=Arrivals("closed", concurrency=8), prompt_len=Lengths.fixed(16),
                         output_len=Lengths.fixed(512), seed=seed + 1, warmup=0) if busy_decode else
            WorkloadSpec(num_requests=10_000, arrivals=Arrivals("closed", concurrency=2),
                         prompt_len=Lengths.fixed(256), output_len=Lengths.fixed(1), seed=seed + 1, warmup=0))

    async def both():
        background = asyncio.ensure_future(run_async(busy, base_url, progress=False))
        await asyncio.sleep(2.0)  # the prefill worker is busy before the probe starts
        try:
            return (await run_async(probe, base_url)).records
        finally:
            background.cancel()
            await asyncio.gather(background, return_exceptions=True)

    return [r for r in asyncio.run(both()) if r.ok and len(r.chunk_times) == output]


def serving_cost(base_url: str, profile: HardwareProfile, seed: int) -> dict[str, float]:
    """What serving adds to the engine, in seconds: ``served_step_s`` and ``served_seq_s`` per
    decode step (solved from the served step at batch 1 and at batch 16 against the profile's
    steps there), ``kv_transfer_overhead_s``, the hand-off beyond the KV bytes over the link,
    and ``served_prefill_factor``, a served prefill's time over the profile's."""
    cost = CostModel(PRESETS["SmolLM2-135M"], profile, 1)
    extra, handoff = {}, []
    # seeds of their own (each probe and its background client), and apart from every run's:
    # a prompt the prefix cache has seen would skip its prefill
    for batch, prompt, output, n, k in ((1, 256, 64, 8, 1), (PROBE_BATCH, PROBE_PROMPT, PROBE_OUTPUT, 32, 3)):
        records = _probe(base_url, batch, prompt, output, n, 10 * seed + k)
        gaps = [b - a for r in records for a, b in zip(r.chunk_times[1:], r.chunk_times[2:])]
        step = float(np.median(gaps))
        bare = cost.decode_s(batch, batch * (prompt + output // 2))
        extra[batch] = step - bare
        if batch == 1:  # the first gap is the hand-off plus one step
            handoff = [r.chunk_times[1] - r.chunk_times[0] - step for r in records]
        print(f"served probe, batch {batch}: decode step {step * 1e3:.1f} ms served, {bare * 1e3:.1f} ms in the "
              f"profile" + (f"; hand-off {np.median(handoff) * 1e3:.1f} ms (median of {len(handoff)})"
                            if batch == 1 else ""))
    per_seq = max(0.0, (extra[PROBE_BATCH] - extra[1]) / (PROBE_BATCH - 1))
    per_step = max(0.0, extra[1] - per_seq)
    link = max(0.0, float(np.median(handoff)) - (cost.transfer_s(256) - profile.kv_transfer_overhead_s))
    # A served prefill: 256-token prompts one at a time (one output token: no decode), the
    # decode worker busy on the other core, against the profile's prefill alone.
    records = _probe(base_url, 1, 256, 1, 6, 10 * seed + 5, busy_decode=True)
    ttft = float(np.median([r.chunk_times[0] - r.sent for r in records]))
    factor = max(1.0, ttft / cost.prefill_s([(256, 0)]))
    print(f"served probe, prefill: 256 tokens in {ttft * 1e3:.0f} ms served (TTFT), "
          f"{cost.prefill_s([(256, 0)]) * 1e3:.0f} ms in the profile")
    return {"served_step_s": per_step, "served_seq_s": per_seq, "kv_transfer_overhead_s": link,
            "served_prefill_factor": factor}


def workload(w: dict, arrivals_s: list[float] | None = None) -> list[TraceRequest]:
    if arrivals_s is not None:  # the served run's own send times
        return [TraceRequest(float(t), w["input_len"], w["output_len"]) for t in arrivals_s]
    if "max_concurrency" in w:  # a closed loop: the simulator's clients send them (times unused)
        return [TraceRequest(0.0, w["input_len"], w["output_len"])] * w["num_prompts"]
    rng = np.random.default_rng(w.get("seed", 0))
    times = np.cumsum(rng.exponential(1 / w["request_rate"], w["num_prompts"]))
    return [TraceRequest(float(t - times[0]), w["input_len"], w["output_len"]) for t in times]


def simulate(run: dict, profile: HardwareProfile) -> dict:
    cost = CostModel(PRESETS["SmolLM2-135M"], profile, 1)
    requests = workload(run["workload"], run.get("arrivals_s"))
    result = Simulator(ClusterSpec(parse_layout(run["layout"]), cost, cost, EngineLimits()), requests,
                       closed_loop=run["workload"].get("max_concurrency")).run()
    pct = result.percentiles()
    return {"ttft_ms": {k: v * 1e3 for k, v in pct["ttft_s"].items()},
            "tpot_ms": {k: v * 1e3 for k, v in pct["tpot_s"].items()}}


def simulate_draws(run: dict, profile: HardwareProfile, seeds: int) -> list[dict]:
    """``simulate`` over ``seeds`` draws of the arrival times (seeds 0..seeds-1); the run's own
    arrivals, once, when it recorded them."""
    if "arrivals_s" in run or "max_concurrency" in run["workload"]:  # nothing random to draw
        return [simulate(run, profile)]
    return [simulate({**run, "workload": {**run["workload"], "seed": seed}}, profile) for seed in range(seeds)]


def refit(template: HardwareProfile, points_path: str) -> HardwareProfile:
    """``template`` (link, memory) with its compute, bandwidth and overheads fitted to other points."""
    rows = json.loads(Path(points_path).read_text())
    points = [Point(r["kind"], r["batch"], r["tokens"], r["measured_s"]) for r in rows]
    f = fit(PRESETS["SmolLM2-135M"], template.dtype_bytes, points)  # the bandwidth fitted too: none measured
    spec = PRESETS["SmolLM2-135M"]
    return dataclasses.replace(template, peak_flops=f.flops, peak_mem_bw=f.mem_bw, step_overhead_s=f.overhead_s,
                               seq_overhead_s=f.seq_overhead_s, prefill_attention_flops=f.prefill_attention_flops,
                               decode_attention_flops=f.decode_attention_flops,
                               decode_points=tuple((p.batch, p.tokens, p.seconds) for p in points if p.kind == "decode"),
                               points_model=spec.shape, source=f"fitted to {points_path}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--measured", nargs="+", default=[str(p) for p in sorted((ROOT / "benchmarks/planner/calibration").glob("set*.json"),
                                                     key=lambda p: int(p.stem[3:]))],
                    help="measured files (default: the recorded sets); with --measure, the one file to write")
    ap.add_argument("--profile", default=None, help="compare every set with this profile (default: each set's "
                    "own, taken with it by --reprofile --measure, else planner/profiles/cpu.json)")
    ap.add_argument("--reprofile", action="store_true", help="run `pdserve profile` first (minutes)")
    ap.add_argument("--seeds", type=int, default=40, help="draws of the arrival times to average over")
    ap.add_argument("--points", default=None, help="fit the profile to these step times (JSON list of "
                    "{kind, batch, tokens, measured_s}) instead of reading --profile")
    ap.add_argument("--measure", default=None, metavar="URL",
                    help="take the served runs now against this running cluster (writes --measured)")
    ap.add_argument("--measure-seed", type=int, default=100, help="--measure's workload seed (prompts, arrivals)")
    ap.add_argument("--serving-cost", action="store_true", help="with --reprofile --measure: add what serving costs "
                    "beyond the bare engine (decode probes at batch 1 and 16, the hand-off, a prefill probe) to the profile")
    args = ap.parse_args()
    if args.measure and len(args.measured) != 1:
        ap.error("--measure writes one file: give one --measured")
    if args.reprofile:
        out = args.profile or str(DEFAULT_CPU_PROFILE)
        subprocess.run([sys.executable, "-m", "cluster.cli", "profile", "--output", out], check=True, cwd=ROOT)
    if args.measure and args.reprofile and args.serving_cost:
        base = HardwareProfile.load(out)
        served = serving_cost(args.measure, base, 1000 + args.measure_seed)
        dataclasses.replace(base, **served, source=f"{base.source}; plus the served probe's "
                            f"{served['served_step_s'] * 1e3:.2f} ms a step, {served['served_seq_s'] * 1e3:.2f} ms a "
                            f"sequence and {served['kv_transfer_overhead_s'] * 1e3:.1f} ms a hand-off, prefill "
                            f"x{served['served_prefill_factor']:.3f}").save(out)
    if args.measure:
        doc = measure(args.measure, args.measure_seed)
        if args.reprofile:  # the set keeps the profile taken with it
            doc["profile"] = json.loads(Path(out).read_text())
        Path(args.measured[0]).parent.mkdir(parents=True, exist_ok=True)
        Path(args.measured[0]).write_text(json.dumps(doc, indent=1) + "\n")
    fixed = HardwareProfile.load(args.profile) if args.profile else None
    worst = 0.0
    for path in args.measured:
        measured = json.loads(Path(path).read_text())
        if fixed is not None:
            profile = fixed
        elif "profile" in measured:
            profile = HardwareProfile(**measured["profile"])
        else:
            profile = HardwareProfile.load(DEFAULT_CPU_PROFILE)
        if args.points:
            profile = refit(profile, args.points)
        worst = max(worst, compare(measured, path, profile, args.seeds))
    print(f"worst relative error {worst:.1%} (target {TOLERANCE:.0%}): {'met' if worst <= TOLERANCE else 'NOT met'}")
    return 0


def compare(measured: dict, path: str, profile: HardwareProfile, seeds: int) -> float:
    """Print one measured file against the simulator; its worst relative error."""
    print(f"\nmeasured: {measured.get('source', path)}")
    print(f"profile:  {profile.source}")
    print(f"{'run':<34} {'metric':<8} {'measured ms':>12} {'simulated ms':>13} {'error':>8}  draws 10-90% ms")
    worst = 0.0
    for run in measured["runs"]:
        draws = simulate_draws(run, profile, seeds)
        for metric, values in run["measured"].items():
            for pct, value in values.items():
                sims = np.array([d[metric][pct] for d in draws])
                got = float(sims.mean())
                err = (got - value) / value
                worst = max(worst, abs(err))
                lo, hi = np.percentile(sims, [10, 90])
                print(f"{run['name']:<34} {metric[:-3] + ' ' + pct:<8} {value:12.1f} {got:13.1f} {err:+8.1%}  "
                      f"{lo:.1f}-{hi:.1f}")
    print(f"worst relative error here {worst:.1%}")
    return worst


if __name__ == "__main__":
    sys.exit(main())
