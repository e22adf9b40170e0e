"""Calibration: the simulator with this machine's fitted CPU profile against the serving
benchmark's measured TTFT and TPOT percentiles. Target: within 25% of each measured value.

    PYTHONPATH=. .venv/bin/python benchmarks/planner/calibrate.py                 # current profile
    PYTHONPATH=. .venv/bin/python benchmarks/planner/calibrate.py --reprofile     # re-measure the engine first
    PYTHONPATH=. .venv/bin/python benchmarks/planner/calibrate.py --measured my_run.json
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
``num_prompts`` of them, fixed lengths (``--random-range-ratio 0``, ``--ignore-eos``). Only
open-loop runs can be replayed: the simulator has no closed-loop client. The served run drew
its arrival times from vLLM's random generator, which this script cannot repeat, and with 32
prompts near saturation one draw of arrival times moves TTFT by tens of percent. So the
simulated value is the mean over ``--seeds`` draws, printed with the 10-90% range of the draws.
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


def workload(w: dict) -> list[TraceRequest]:
    if "max_concurrency" in w:
        raise SystemExit("calibrate: closed-loop runs (max_concurrency) cannot be replayed; use request_rate runs")
    rng = np.random.default_rng(w.get("seed", 0))
    times = np.cumsum(rng.exponential(1 / w["request_rate"], w["num_prompts"]))
    return [TraceRequest(float(t - times[0]), w["input_len"], w["output_len"]) for t in times]


def simulate(run: dict, profile: HardwareProfile) -> dict:
    cost = CostModel(PRESETS["SmolLM2-135M"], profile, 1)
    result = Simulator(ClusterSpec(parse_layout(run["layout"]), cost, cost, EngineLimits()), workload(run["workload"])).run()
    pct = result.percentiles()
    return {"ttft_ms": {k: v * 1e3 for k, v in pct["ttft_s"].items()},
            "tpot_ms": {k: v * 1e3 for k, v in pct["tpot_s"].items()}}


def simulate_draws(run: dict, profile: HardwareProfile, seeds: int) -> list[dict]:
    """``simulate`` over ``seeds`` draws of the arrival times (seeds 0..seeds-1)."""
    return [simulate({**run, "workload": {**run["workload"], "seed": seed}}, profile) for seed in range(seeds)]


def refit(template: HardwareProfile, points_path: str) -> HardwareProfile:
    """``template`` (link, memory) with its compute, bandwidth and overheads fitted to other points."""
    rows = json.loads(Path(points_path).read_text())
    points = [Point(r["kind"], r["batch"], r["tokens"], r["measured_s"]) for r in rows]
    f = fit(PRESETS["SmolLM2-135M"], template.dtype_bytes, points)
    return dataclasses.replace(template, peak_flops=f.flops, peak_mem_bw=f.mem_bw, step_overhead_s=f.overhead_s,
                               seq_overhead_s=f.seq_overhead_s, source=f"fitted to {points_path}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--measured", default=str(ROOT / "benchmarks/planner/serving_measured.json"))
    ap.add_argument("--profile", default=str(DEFAULT_CPU_PROFILE))
    ap.add_argument("--reprofile", action="store_true", help="run `pdserve profile` first (minutes)")
    ap.add_argument("--seeds", type=int, default=40, help="draws of the arrival times to average over")
    ap.add_argument("--points", default=None, help="fit the profile to these step times (JSON list of "
                    "{kind, batch, tokens, measured_s}) instead of reading --profile")
    args = ap.parse_args()
    if args.reprofile:
        subprocess.run([sys.executable, "-m", "cluster.cli", "profile", "--output", args.profile], check=True, cwd=ROOT)
    measured = json.loads(Path(args.measured).read_text())
    profile = HardwareProfile.load(args.profile)
    if args.points:
        profile = refit(profile, args.points)
    print(f"measured: {measured.get('source', args.measured)}")
    print(f"profile:  {profile.source}")
    print(f"{'run':<34} {'metric':<8} {'measured ms':>12} {'simulated ms':>13} {'error':>8}  draws 10-90% ms")
    worst = 0.0
    for run in measured["runs"]:
        draws = simulate_draws(run, profile, args.seeds)
        for metric, values in run["measured"].items():
            for pct, value in values.items():
                sims = np.array([d[metric][pct] for d in draws])
                got = float(sims.mean())
                err = (got - value) / value
                worst = max(worst, abs(err))
                lo, hi = np.percentile(sims, [10, 90])
                print(f"{run['name']:<34} {metric[:-3] + ' ' + pct:<8} {value:12.1f} {got:13.1f} {err:+8.1%}  "
                      f"{lo:.1f}-{hi:.1f}")
    print(f"worst relative error {worst:.1%} (target {TOLERANCE:.0%}): {'met' if worst <= TOLERANCE else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
