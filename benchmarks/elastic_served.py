"""Elastic roles served, on this machine (issue 29): a workload whose mix shifts from long prompts
with short answers to short prompts with long answers and back, against one SLO, served by each
fixed split of N workers, N colocated workers, one colocated worker on every core, and by
elastic roles with the budget policy (``--elastic-roles --role-budget``), one server at a time.
Goodput = requests meeting both SLOs per second of the whole run; the elastic run's role
timeline (the router's ``pdserve:pool_replicas`` and ``pdserve:mixed_workers``) is plotted
against each pool's pressure (``pdserve:role_budget_pressure``), all scraped once a second.

    .venv/bin/python benchmarks/elastic_served.py [--workers 3] [--phase-s 60] [--plot P] [--json J]

Each phase runs the load generator (benchmarks/load) open loop; phases follow each other
without a pause. The budget policy is given the benchmark's SLOs as its own.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.goodput import HOST, free_port  # noqa: E402
from benchmarks.load import SLO, Arrivals, WorkloadSpec, parse_lengths, run  # noqa: E402
from pdserve.cluster.autoscaling.budget import BudgetConfig  # noqa: E402
from benchmarks.load.metrics import meets_slo, percentile, tpot, ttft  # noqa: E402
from benchmarks.elastic_plan import plot_roles  # noqa: E402
from benchmarks.processor import print_banner  # noqa: E402
from benchmarks.serving_procs import ServerProcess  # noqa: E402

SERIES = re.compile(r'^pdserve:(pool_replicas|role_budget_pressure)\{pool="(prefill|decode)"\} ([0-9.eE+-]+)$')
MIXED = re.compile(r'^pdserve:mixed_workers ([0-9.eE+-]+)$')


def phases(args) -> list[tuple[str, float, str, str]]:
    """(name, rate, prompt lengths, output lengths) per phase."""
    prompts = (args.rate_prompts, f"lognormal:{args.long_prompt}:0.3:64:2048", "lognormal:16:0.3:4:64")
    answers = (args.rate_answers, "lognormal:64:0.3:16:256", f"lognormal:{args.long_output}:0.3:32:1024")
    return [("long prompts", *prompts), ("long answers", *answers), ("long prompts again", *prompts)]


def layouts(args) -> list[tuple[str, list[str]]]:
    n = args.workers
    fixed = [(f"{k}P:{n - k}D", ["--prefill", str(k), "--decode", str(n - k)]) for k in range(1, n)]
    # colocated: n workers of a core each, and one worker on all the cores (torch threads = cores / workers)
    fixed += [(f"colocated {n}", ["--mode", "colocated", "--decode", str(n)]),
              ("colocated 1", ["--mode", "colocated", "--decode", "1"])]
    start = _elastic_start(args)  # default prefill-heavy, as phase 1 wants
    elastic = (f"elastic from {start}P:{n - start}D",
               ["--prefill", str(start), "--decode", str(n - start), "--elastic-roles", "--role-budget",
                "--role-budget-dwell-s", str(args.dwell_s), "--role-budget-window-s", str(args.window_s),
                "--role-budget-ttft-slo-s", str(args.slo_ttft_ms / 1000),
                "--role-budget-itl-slo-s", str(args.slo_tpot_ms / 1000)])
    return fixed + [elastic]


class Scraper:
    """The router's pool sizes and budget pressures, once a second, on a thread."""

    def __init__(self, url: str):
        self.url, self.rows, self._stop = url, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self.t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(5)

    def _run(self):
        while not self._stop.wait(1.0):
            try:
                with urllib.request.urlopen(f"{self.url}/metrics", timeout=5) as r:
                    text = r.read().decode()
            except OSError:
                continue
            row = {"t": time.monotonic() - self.t0}
            for line in text.splitlines():
                m = SERIES.match(line)
                if m:
                    row[f"{m.group(1)}:{m.group(2)}"] = float(m.group(3))
                elif (m := MIXED.match(line)):
                    row["mixed_workers"] = float(m.group(1))
            self.rows.append(row)


def serve_one(args, name: str, flags: list[str], slo: SLO) -> dict:
    http, grpc = free_port(), free_port()
    cmd = [str(Path(sys.executable).parent / "pdserve"), "serve", "--port", str(http), "--grpc-port", str(grpc),
           "--log-level", "info", *flags]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    log = args.out_dir / f"{re.sub(r'[^A-Za-z0-9]+', '_', name)}.log"
    with ServerProcess("pdserve", cmd, env, HOST, [http, grpc], log) as server:
        startup = server.wait_healthy(600, lambda t: None)
        url = f"http://{HOST}:{http}"
        print(f"[{name}] healthy after {startup:.0f} s", flush=True)
        warm = WorkloadSpec(num_requests=4, arrivals=Arrivals("closed", concurrency=1),
                            prompt_len=parse_lengths("fixed:256", "p"), output_len=parse_lengths("fixed:16", "o"),
                            warmup=0, seed=args.seed + 99)
        run(warm, url, progress=False)
        records, t0 = [], time.monotonic()
        with Scraper(url) as scraper:
            threads = []
            for i, (phase, rate, prompt, output) in enumerate(phases(args)):
                spec = WorkloadSpec(num_requests=max(1, round(rate * args.phase_s)),
                                    arrivals=Arrivals("poisson", rate=rate), prompt_len=parse_lengths(prompt, "prompt"),
                                    output_len=parse_lengths(output, "output"), slo=slo, warmup=0,
                                    seed=args.seed + i, request_timeout_s=300)
                # each phase on a thread of its own, started at its nominal time: a backlog left by
                # one phase overlaps the next, as when a day's traffic shifts
                time.sleep(max(0.0, i * args.phase_s - (time.monotonic() - t0)))
                thread = threading.Thread(target=lambda spec=spec, phase=phase: records.extend(
                    (phase, r) for r in run(spec, url, progress=False).records), daemon=True)
                thread.start()
                threads.append(thread)
            for thread in threads:
                thread.join()
            duration = time.monotonic() - t0
        for phase, *_ in phases(args):
            done = [r for p, r in records if p == phase]
            ttfts = [ttft(r) * 1000 for r in done if r.ok]
            tpots = [x * 1000 for x in (tpot(r) for r in done if r.ok) if x is not None]
            print(f"[{name}] {phase}: {sum(r.ok for r in done)}/{len(done)} done, "
                  f"{sum(meets_slo(r, slo) for r in done)} met the SLO; TTFT p50/p90 "
                  f"{percentile(ttfts, 50):.0f}/{percentile(ttfts, 90):.0f} ms, TPOT p50/p90 "
                  f"{percentile(tpots, 50):.1f}/{percentile(tpots, 90):.1f} ms", flush=True)
    met = sum(meets_slo(r, slo) for _, r in records)
    failed = sum(not r.ok for _, r in records)
    by_phase = {}
    for phase, r in records:
        n, m = by_phase.get(phase, (0, 0))
        by_phase[phase] = (n + 1, m + meets_slo(r, slo))
    return {"layout": name, "flags": flags, "requests": len(records), "failed": failed, "met": met,
            "duration_s": duration, "goodput_req_s": met / duration, "attainment": met / max(len(records), 1),
            "by_phase": {k: {"requests": n, "met": m} for k, (n, m) in by_phase.items()}, "timeline": scraper.rows}


def simulate(args, slo: SLO, profile: str) -> dict[str, float]:
    """The same phases in ``pdserve plan``'s simulator with the hardware profile ``profile``
    (``cpu``: the one ``pdserve profile`` fitted on this machine): each layout's goodput by the
    served layout's name (one colocated worker on every core is not modelled: a CPU profile is
    of one thread). The elastic run replays the budget policy with the served run's settings."""
    from pdserve.cluster.autoscaling import pool_config
    from pdserve.planner.elastic import ElasticDriver, compare_layouts
    from pdserve.planner.hardware import get_profile
    from pdserve.planner.metrics import Slo
    from pdserve.planner.model_spec import get_model
    from pdserve.planner.search import PlanRequest
    from pdserve.planner.layout import Layout
    from pdserve.planner.synthetic import LengthMix, shifting

    prompts, answers = LengthMix(args.long_prompt, 16, 0.3, 2048), LengthMix(64, args.long_output, 0.3, 1024)
    trace = shifting([(args.phase_s, args.rate_prompts, prompts), (args.phase_s, args.rate_answers, answers),
                      (args.phase_s, args.rate_prompts, prompts)], args.seed)
    sim_slo = Slo(slo.ttft_ms / 1000, slo.tpot_ms / 1000)
    req = PlanRequest(get_model("SmolLM2-135M"), get_profile(profile), 1.0, prompts, sim_slo)
    budget = BudgetConfig(dwell_s=args.dwell_s, window_s=args.window_s, ttft_slo_s=sim_slo.ttft_s,
                          itl_slo_s=sim_slo.tpot_s)
    driver = ElasticDriver(budget, budget.targets({pool: pool_config(pool) for pool in ("prefill", "decode")}))
    n, start = args.workers, _elastic_start(args)
    rows = compare_layouts(req, trace, Layout(start, n - start), driver)
    names = [f"{k}P:{n - k}D" for k in range(1, n)] + [f"colocated {n}", f"elastic from {start}P:{n - start}D"]
    return {name: result.goodput_rps(sim_slo) for name, (_, result) in zip(names, rows)}


def _elastic_start(args) -> int:
    """The prefill workers elastic roles start with: ``--elastic-prefill``, or half rounded up."""
    n = args.workers
    return args.elastic_prefill or (n // 2 if n % 2 == 0 else n // 2 + 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--phase-s", type=float, default=60.0)
    ap.add_argument("--rate-prompts", type=float, default=2.0)
    ap.add_argument("--rate-answers", type=float, default=3.0)
    ap.add_argument("--long-prompt", type=int, default=768)
    ap.add_argument("--long-output", type=int, default=192)
    ap.add_argument("--slo-ttft-ms", type=float, default=1500.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=60.0)
    ap.add_argument("--dwell-s", type=float, default=10.0)
    ap.add_argument("--window-s", type=float, default=8.0)
    ap.add_argument("--elastic-prefill", type=int, default=None,
                    help="prefill workers elastic roles start with (default: half, rounded up)")
    ap.add_argument("--simulate", default=None, metavar="PROFILE",
                    help="also simulate each layout with this hardware profile (cpu: `pdserve profile`'s fit of this "
                         "machine, or a profile .json) and print the simulated goodput beside the served one")
    ap.add_argument("--only", default=None, help="run only the layouts whose name contains this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", type=Path, default=ROOT / ".bench" / "elastic")
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    info = print_banner()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms)
    todo = [(n, f) for n, f in layouts(args) if args.only is None or args.only in n]
    rows = []
    for i, (name, flags) in enumerate(todo):
        print(f"[{'#' * (i + 1)}{'.' * (len(todo) - i - 1)}] {name}", flush=True)
        rows.append(serve_one(args, name, flags, slo))
    fixed = [r["goodput_req_s"] for r in rows if not r["layout"].startswith("elastic")]
    best = max(fixed) if fixed else None
    print(f"\nSLO TTFT {slo.ttft_ms:.0f} ms, TPOT {slo.tpot_ms:.0f} ms; phases of {args.phase_s:.0f} s: "
          + ", ".join(f"{p} {r} req/s ({pl} in, {ol} out)" for p, r, pl, ol in phases(args)) + "\n")
    simulated = simulate(args, slo, args.simulate) if args.simulate else {}
    print("| layout | goodput req/s | met / requests | failed | vs best fixed | simulated goodput | served / simulated |"
          "\n|---|---|---|---|---|---|---|")
    for r in rows:
        vs = f"{r['goodput_req_s'] / best:.2f}x" if best else "—"
        sim = simulated.get(r["layout"])
        r["simulated_goodput_req_s"] = sim
        agree = f"{r['goodput_req_s'] / sim:.2f}" if sim else "—"
        print(f"| {r['layout']} | {r['goodput_req_s']:.3f} | {r['met']} / {r['requests']} | {r['failed']} | {vs} | "
              f"{'—' if sim is None else f'{sim:.3f}'} | {agree} |")
    bound = switching_bound(rows)
    if bound:
        print(f"\nper-phase best fixed layout ({', '.join(f'{p}: {l}' for p, l in bound['best_per_phase'].items())}), "
              f"as if switched for free at each phase: {bound['goodput_req_s']:.3f} req/s = "
              f"{bound['vs_best_fixed']:.2f}x the best fixed layout")
    doc = {"machine": info, "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
           "switching_bound": bound}
    out = args.json or args.out_dir / "elastic_served.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}")
    elastic = [r for r in rows if r["layout"].startswith("elastic")]
    if args.plot and elastic:
        plot(elastic[0], args.phase_s, args.plot)
        print(f"wrote {args.plot}")
    return 0


def switching_bound(rows: list[dict]) -> dict | None:
    """What switching between the fixed layouts could reach on this run's mix, were each
    switch free and made at the phase's start: the fixed layouts' best count of requests met
    in each phase, added up, over their mean run length. Against the best fixed layout it says
    how much room the mix leaves for switching: when one layout wins every phase, switching
    among them gains nothing. Not a strict bound on elastic roles, which also hold states no
    fixed layout has (a prefill worker beside a mixed one) and can beat each in a phase.
    None without at least two fixed layouts."""
    fixed = [r for r in rows if not r["layout"].startswith("elastic")]
    if len(fixed) < 2:
        return None
    best = {phase: max(fixed, key=lambda r: r["by_phase"][phase]["met"]) for phase in fixed[0]["by_phase"]}
    met = sum(r["by_phase"][phase]["met"] for phase, r in best.items())
    duration = sum(r["duration_s"] for r in fixed) / len(fixed)
    top = max(r["goodput_req_s"] for r in fixed)
    return {"goodput_req_s": met / duration, "vs_best_fixed": met / duration / top,
            "best_per_phase": {phase: r["layout"] for phase, r in best.items()}}


def plot(row: dict, phase_s: float, path: Path) -> None:
    timeline = row["timeline"]
    t = [x["t"] for x in timeline]
    series = {pool: (t, [x.get(f"pool_replicas:{pool}", float("nan")) for x in timeline],
                     [x.get(f"role_budget_pressure:{pool}", float("nan")) for x in timeline])
              for pool in ("prefill", "decode")}
    series["mixed"] = (t, [x.get("mixed_workers", float("nan")) for x in timeline])
    plot_roles(series, BudgetConfig(), phase_s, f"{row['layout']}, served: each pool's workers against its pressure",
               path)


if __name__ == "__main__":
    sys.exit(main())
