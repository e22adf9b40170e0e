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

``--step-trace DIR``, for a cluster started with ``pdserve serve --step-trace-dir DIR``, keeps
the engine steps each run made in both workers (``traced_steps``), and the comparison adds a
second simulation of the run at the speed those steps ran at: the profile's prefill and
decode steps scaled by one measured factor per pool (``run_speed``). The profile says how a
step's time depends on its batch, chunks and KV; the trace says how fast this machine was
while the run lasted.
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

from pdserve.planner.cli import parse_layout  # noqa: E402
from pdserve.planner.cost import CostModel  # noqa: E402
from pdserve.planner.hardware import DEFAULT_CPU_PROFILE, HardwareProfile  # noqa: E402
from pdserve.planner.model_spec import get_model  # noqa: E402
from pdserve.planner.profile import Point, fit  # noqa: E402
from pdserve.planner.layout import ClusterSpec  # noqa: E402
from pdserve.planner.simulator import Simulator  # noqa: E402
from pdserve.planner.trace import TraceRequest  # noqa: E402
from pdserve.planner.worker import EngineLimits  # noqa: E402

from benchmarks.planner.served_runs import measure, serving_cost  # noqa: E402

TOLERANCE = 0.25


# The machine's speed during a run. This machine's speed drifts by 15-30% within minutes, so a
# profile taken minutes before a run can be that far from the run's own speed. A cluster
# started with ``--step-trace-dir`` logs every engine step (engine.step_trace); a run keeps
# the steps each pool ran while it lasted, and the profile's time for each of those very
# steps (the same batch, chunks and KV) sets one factor per pool: the served seconds over the
# profile's seconds. A step's served seconds include the loop's time before it (its queued
# calls, hooks and outputs), unless the loop was idle there. The simulation at the run's
# speed scales the profile's prefill and decode steps by those factors, and nothing else:
# which steps run, with which batch, and how long requests wait stay the simulator's.
def run_speed(steps: dict, profile: HardwareProfile) -> dict[str, float]:
    """Each pool's served seconds over the profile's engine seconds for the same steps, and
    ``prefill_sigma``: the spread (standard deviation of the log) of that ratio step by step."""
    bare = dataclasses.replace(profile, served_prefill_factor=1.0, served_decode_factor=1.0, served_step_s=0.0,
                               served_seq_s=0.0, borrow_prefill_factor=1.0, borrow_decode_factor=1.0)
    cost = CostModel(get_model("SmolLM2-135M"), bare, 1)
    prefill = [(s, cost.prefill_s([tuple(c) for c in chunks], sampled)) for s, chunks, sampled in steps["prefill"]]
    decode = [(s, cost.decode_s(batch, context)) for s, batch, context in steps["decode"]]
    speed = {pool: sum(s for s, _ in rows) / sum(p for _, p in rows)
             for pool, rows in (("prefill", prefill), ("decode", decode)) if rows}
    speed["prefill_sigma"] = float(np.std(np.log([s / p for s, p in prefill]))) if len(prefill) > 1 else 0.0
    return speed


def at_run_speed(profile: HardwareProfile, speed: dict[str, float]) -> HardwareProfile:
    """``profile`` with its steps at a run's measured speed: the factors stand for what the
    served probe's step costs stood for (their time is in the traced steps), the hand-off stays."""
    return dataclasses.replace(profile, served_prefill_factor=speed["prefill"], served_decode_factor=speed["decode"],
                               served_step_s=0.0, served_seq_s=0.0, borrow_prefill_factor=1.0, borrow_decode_factor=1.0,
                               source=f"{profile.source}; at the run's traced speed, prefill x{speed['prefill']:.3f}, "
                                      f"decode x{speed['decode']:.3f}")


def workload(w: dict, arrivals_s: list[float] | None = None) -> list[TraceRequest]:
    if arrivals_s is not None:  # the served run's own send times
        return [TraceRequest(float(t), w["input_len"], w["output_len"]) for t in arrivals_s]
    if "max_concurrency" in w:  # a closed loop: the simulator's clients send them (times unused)
        return [TraceRequest(0.0, w["input_len"], w["output_len"])] * w["num_prompts"]
    rng = np.random.default_rng(w.get("seed", 0))
    times = np.cumsum(rng.exponential(1 / w["request_rate"], w["num_prompts"]))
    return [TraceRequest(float(t - times[0]), w["input_len"], w["output_len"]) for t in times]


class NoisyPrefill:
    """``cost`` with each prefill step's time multiplied by a log-normal draw (mean 1, log
    spread ``sigma``): the step-to-step spread a trace measured. Near saturation, which prompts
    share a prefill step turns on tens of milliseconds (a prompt arriving just before or just
    after a step starts), and every later step follows from it; one replay with exact step
    times is one outcome of many that the same machine could have produced."""

    def __init__(self, cost: CostModel, sigma: float, seed: int):
        self._cost, self._sigma, self._rng = cost, sigma, np.random.default_rng(seed)

    def prefill_s(self, chunks, num_sampled: int = 1) -> float:
        draw = float(np.exp(self._rng.normal(-self._sigma ** 2 / 2, self._sigma)))
        return self._cost.prefill_s(chunks, num_sampled) * draw

    def __getattr__(self, name: str):
        return getattr(self._cost, name)


def simulate(run: dict, profile: HardwareProfile, prefill_sigma: float = 0.0, seed: int = 0) -> dict:
    cost = CostModel(get_model("SmolLM2-135M"), profile, 1)
    prefill = NoisyPrefill(cost, prefill_sigma, seed) if prefill_sigma else cost
    requests = workload(run["workload"], run.get("arrivals_s"))
    result = Simulator(ClusterSpec(parse_layout(run["layout"]), prefill, cost, EngineLimits()), requests,
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
    f = fit(get_model("SmolLM2-135M"), template.dtype_bytes, points)  # the bandwidth fitted too: none measured
    spec = get_model("SmolLM2-135M")
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
                    "own, taken with it by --reprofile --measure, else pdserve/planner/profiles/cpu.json)")
    ap.add_argument("--reprofile", action="store_true", help="run `pdserve profile` first (minutes)")
    ap.add_argument("--seeds", type=int, default=40, help="draws of the arrival times to average over")
    ap.add_argument("--points", default=None, help="fit the profile to these step times (JSON list of "
                    "{kind, batch, tokens, measured_s}) instead of reading --profile")
    ap.add_argument("--measure", default=None, metavar="URL",
                    help="take the served runs now against this running cluster (writes --measured)")
    ap.add_argument("--measure-seed", type=int, default=100, help="--measure's workload seed (prompts, arrivals)")
    ap.add_argument("--serving-cost", action="store_true", help="with --reprofile --measure: add what serving costs "
                    "beyond the bare engine (decode probes at batch 1 and 16, the hand-off, a prefill probe) to the profile")
    ap.add_argument("--step-trace", default=None, metavar="DIR",
                    help="with --measure: the cluster's --step-trace-dir; each run keeps the engine steps it ran, "
                    "and is compared also at the speed they ran at")
    args = ap.parse_args()
    if args.step_trace and not args.measure:
        ap.error("--step-trace needs --measure (a recorded set keeps its traced steps)")
    if args.measure and len(args.measured) != 1:
        ap.error("--measure writes one file: give one --measured")
    if args.reprofile:
        out = args.profile or str(DEFAULT_CPU_PROFILE)
        subprocess.run([sys.executable, "-m", "pdserve.cli", "profile", "--output", out], check=True, cwd=ROOT)
    if args.measure and args.reprofile and args.serving_cost:
        base = HardwareProfile.load(out)
        served = serving_cost(args.measure, base, 1000 + args.measure_seed)
        dataclasses.replace(base, **served, source=f"{base.source}; plus the served probe's "
                            f"{served['served_step_s'] * 1e3:.2f} ms a step, {served['served_seq_s'] * 1e3:.2f} ms a "
                            f"sequence and {served['kv_transfer_overhead_s'] * 1e3:.1f} ms a hand-off, prefill "
                            f"x{served['served_prefill_factor']:.3f}; borrowing idle cores, prefill "
                            f"x{served['borrow_prefill_factor']:.3f}, decode x{served['borrow_decode_factor']:.3f}").save(out)
    if args.measure:
        doc = measure(args.measure, args.measure_seed, args.step_trace)
        if args.reprofile:  # the set keeps the profile taken with it
            doc["profile"] = json.loads(Path(out).read_text())
        Path(args.measured[0]).parent.mkdir(parents=True, exist_ok=True)
        # thousands of traced steps: one line, not one per number
        text = json.dumps(doc, separators=(",", ":")) if args.step_trace else json.dumps(doc, indent=1)
        Path(args.measured[0]).write_text(text + "\n")
    fixed = HardwareProfile.load(args.profile) if args.profile else None
    errors = []
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
        errors += compare(measured, path, profile, args.seeds)
    summarize(errors)
    return 0


def summarize(errors: list[tuple[str, str, float, float | None]]) -> None:
    """By figure (load and percentile) over every set: how many within the target, the range
    and the median of the errors; then the worst, for the profile and at the runs' speed."""
    traced = [e for e in errors if e[3] is not None]
    if len(errors) > 12:
        cols = f"{'within':>7} {'errors':>17} {'median':>8}"
        print(f"\n{'by figure, over the sets':<34} {'metric':<8} {cols}" + (f" | at run speed: {cols}" if traced else ""))
        for key in dict.fromkeys((run, metric) for run, metric, _, _ in errors):
            line = f"{key[0]:<34} {key[1]:<8} "
            for part, errs in enumerate((np.array([e for r, m, e, _ in errors if (r, m) == key]),
                                         np.array([s for r, m, _, s in traced if (r, m) == key]))):
                if len(errs):
                    within = f"{int((abs(errs) <= TOLERANCE).sum())}/{len(errs)}"
                    line += (" | " + " " * 14 if part else "") + (
                        f"{within:>7} {errs.min():+7.1%}..{errs.max():+7.1%} {np.median(errs):+8.1%}")
            print(line)
    verdict = lambda e: "met" if e <= TOLERANCE else "NOT met"  # noqa: E731
    worst = max(abs(e[2]) for e in errors)
    within = sum(abs(e[2]) <= TOLERANCE for e in errors)
    print(f"worst relative error {worst:.1%} (target {TOLERANCE:.0%}): {verdict(worst)}; "
          f"{within} of {len(errors)} figures within")
    if traced:
        worst_s = max(abs(e[3]) for e in traced)
        within_s = sum(abs(e[3]) <= TOLERANCE for e in traced)
        print(f"at each run's traced speed ({len(traced)} figures of traced runs): worst {worst_s:.1%}: "
              f"{verdict(worst_s)}; {within_s} of {len(traced)} within")


def compare(measured: dict, path: str, profile: HardwareProfile, seeds: int) -> list[tuple[str, str, float, float | None]]:
    """Print one measured file against the simulator: with the profile, and (runs with traced
    steps) with the profile at each run's own speed. Each figure's (run, metric, error, error
    at the run's speed or None)."""
    print(f"\nmeasured: {measured.get('source', path)}")
    print(f"profile:  {profile.source}")
    print(f"{'run':<34} {'metric':<8} {'measured ms':>12} {'simulated ms':>13} {'error':>8} "
          f"{'at run speed':>13} {'error':>8}  draws 10-90% ms (at run speed where traced)")
    errors = []
    for run in measured["runs"]:
        draws = simulate_draws(run, profile, seeds)
        speed = run_speed(run["traced_steps"], profile) if "traced_steps" in run else None
        if speed:  # the run's speed, and the spread of its prefill steps drawn step by step
            fast = at_run_speed(profile, speed)
            draws_s = [simulate(run, fast, speed["prefill_sigma"], seed) for seed in range(seeds)]
            print(f"{run['name']}: traced {len(run['traced_steps']['prefill'])} prefill and "
                  f"{len(run['traced_steps']['decode'])} decode steps; served / profile seconds: prefill "
                  f"{speed['prefill']:.3f} (step to step, log sd {speed['prefill_sigma']:.3f}), "
                  f"decode {speed['decode']:.3f}")
        for metric, values in run["measured"].items():
            for pct, value in values.items():
                sims = np.array([d[metric][pct] for d in draws])
                got = float(sims.mean())
                err = (got - value) / value
                line = f"{run['name']:<34} {metric[:-3] + ' ' + pct:<8} {value:12.1f} {got:13.1f} {err:+8.1%} "
                err_s = None
                if speed:
                    sims = np.array([d[metric][pct] for d in draws_s])
                    err_s = (float(sims.mean()) - value) / value
                    line += f"{sims.mean():13.1f} {err_s:+8.1%} "
                else:
                    line += f"{'':13} {'':8} "
                lo, hi = np.percentile(sims, [10, 90])
                print(f"{line} {lo:.1f}-{hi:.1f}")
                errors.append((run["name"], metric[:-3] + " " + pct, err, err_s))
    worst = max(abs(e[2]) for e in errors)
    traced = [abs(e[3]) for e in errors if e[3] is not None]
    print(f"worst relative error here {worst:.1%}" + (f"; at the runs' traced speed {max(traced):.1%}" if traced else ""))
    return errors


if __name__ == "__main__":
    sys.exit(main())
