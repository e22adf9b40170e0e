"""Elastic roles against every fixed layout, in the simulator (``pdserve plan``'s model of the
hardware, not a served run): a workload whose mix shifts from long prompts with short answers
to short prompts with long answers and back, one SLO, goodput per layout, and the elastic run's
role timeline plotted against each pool's pressure.

    .venv/bin/python benchmarks/elastic_plan.py [--hardware H100] [--model Llama-3.1-8B] [--plot docs/benchmarks/elastic_plan.png]

The simulator replays the controller's own budget policy (pdserve/cluster/autoscaling/budget.py)
and the router's own routing policies, the mixed role included; its cost model is the hardware
profile's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.processor import print_banner  # noqa: E402
from pdserve.planner.elastic import ElasticDriver, compare_layouts  # noqa: E402
from pdserve.planner.hardware import get_profile  # noqa: E402
from pdserve.planner.metrics import Slo  # noqa: E402
from pdserve.planner.model_spec import get_model  # noqa: E402
from pdserve.planner.search import PlanRequest  # noqa: E402
from pdserve.planner.layout import Layout  # noqa: E402
from pdserve.planner.synthetic import LengthMix, shifting  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hardware", default="H100")
    ap.add_argument("--model", default="Llama-3.1-8B")
    ap.add_argument("--workers", type=int, default=4, help="the fixed budget; elastic starts from an even split")
    ap.add_argument("--phase-s", type=float, default=150.0, help="seconds per phase (three phases)")
    ap.add_argument("--rate-prompts", type=float, default=25.0, help="req/s while prompts are long")
    ap.add_argument("--rate-answers", type=float, default=40.0, help="req/s while answers are long")
    ap.add_argument("--ttft-slo", type=float, default=1.0)
    ap.add_argument("--tpot-slo", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    info = print_banner()
    long_prompts, long_answers = LengthMix(3000, 60, 0.5, 8192), LengthMix(200, 900, 0.5, 8192)
    trace = shifting([(args.phase_s, args.rate_prompts, long_prompts), (args.phase_s, args.rate_answers, long_answers),
                      (args.phase_s, args.rate_prompts, long_prompts)], args.seed)
    slo = Slo(args.ttft_slo, args.tpot_slo)
    req = PlanRequest(get_model(args.model), get_profile(args.hardware), 1.0, long_prompts, slo)
    start = Layout(args.workers // 2, args.workers - args.workers // 2)
    driver = ElasticDriver()
    total = args.workers + 1
    done = [0]

    def progress(name: str) -> None:
        done[0] += 1
        bar = "#" * done[0] + "." * (total - done[0])
        print(f"[{bar}] simulating {name}", file=sys.stderr, flush=True)

    rows = compare_layouts(req, trace, start, driver, progress)
    best_fixed = max(r.goodput_rps(slo) for name, r in rows[:-1])
    print(f"\n{len(trace)} requests over {3 * args.phase_s:.0f} s on simulated {args.hardware} x {args.workers}, "
          f"{args.model}; SLO TTFT {slo.ttft_s} s, TPOT {slo.tpot_s} s\n")
    print("| layout | goodput req/s | SLO attainment | vs best fixed |\n|---|---|---|---|")
    out = []
    for name, r in rows:
        g = r.goodput_rps(slo)
        print(f"| {name} | {g:.2f} | {r.attainment(slo):.3f} | {g / best_fixed:.2f}x |")
        out.append({"layout": name, "goodput_rps": g, "attainment": r.attainment(slo), "failed": r.failed})
    print("\nelastic switches (decided -> serving, from -> to): "
          + ", ".join(f"{d:.0f}->{s:.1f} s {a}->{b}" for d, s, a, b in driver.switches))
    if args.json:
        args.json.write_text(json.dumps({"machine": info, "args": vars(args) | {"plot": str(args.plot),
                                                                              "json": str(args.json)},
                                         "rows": out, "switches": driver.switches}, indent=1))
    if args.plot:
        plot(driver, args.phase_s, args.plot)
        print(f"wrote {args.plot}")


def plot(driver: ElasticDriver, phase_s: float, path: Path) -> None:
    series = {pool: ([x[0] for x in h], [x[1] for x in h], [x[3] for x in h]) for pool, h in driver.history.items()}
    series["mixed"] = ([t for t, _ in driver.mixed_history], [n for _, n in driver.mixed_history])
    plot_roles(series, driver.config, phase_s, "Elastic roles, simulated: each pool's workers against its pressure",
               path, symlog=True)


def plot_roles(series: dict, config, phase_s: float, title: str, path: Path, symlog: bool = False) -> None:
    """Each pool's workers (top) and pressure (bottom) over time, with the policy's ``high`` and
    ``low`` and the phase boundaries; ``series``: pool -> (times, workers, pressures)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True)
    for pool, color in (("prefill", "tab:blue"), ("decode", "tab:orange")):
        t, workers, pressure = series[pool]
        top.step(t, workers, where="post", color=color, label=f"{pool} workers")
        bottom.plot(t, pressure, color=color, label=f"{pool} pressure")
    if "mixed" in series:  # (times, counts): decode workers in the mixed role
        t, mixed = series["mixed"]
        top.step(t, mixed, where="post", color="tab:green", ls="--", label="of decode: mixed")
    bottom.axhline(config.high, color="red", ls="--", lw=1, label="high (asks for a worker)")
    bottom.axhline(config.low, color="grey", ls=":", lw=1, label="low (may give one up)")
    for ax in (top, bottom):
        for edge in (phase_s, 2 * phase_s):
            ax.axvline(edge, color="black", lw=0.5)
        ax.legend(loc="upper right", fontsize=8)
    top.set_ylabel("workers")
    bottom.set_ylabel("pressure (1 = at target)")
    if symlog:
        bottom.set_yscale("symlog", linthresh=1)
    bottom.set_xlabel("seconds (phases: long prompts | long answers | long prompts)")
    top.set_title(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
