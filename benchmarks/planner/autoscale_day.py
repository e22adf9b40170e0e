"""The built-in autoscaling policies replayed on a bursty day in the simulator.

    PYTHONPATH=. .venv/bin/python benchmarks/planner/autoscale_day.py [--rate 1.0] [--hours 24]

Llama-3.1-8B on L40S workers (TP1), long prompts (mean 4000 tokens, so prefill needs
several workers at the peak) and 300-token answers. Traffic: ``pdserve.planner.synthetic.bursty_day``
(diurnal 0.2x-1.8x of the mean, plus 12 ten-minute bursts at 3x). Autoscaling: the built-in
prefill and decode policies with their default guards (20 s window, 10 s up / 60 s down
cooldowns, step 1), targets as ``pdserve plan`` derives them; a new worker serves 60 s after
it is asked for (model load). Writes docs/benchmarks/autoscale_day.png: replicas per
pool against demand, and SLO attainment per half hour.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pdserve.cluster.autoscaling import pool_config  # noqa: E402
from pdserve.planner.autoscale import AutoscaleDriver  # noqa: E402
from pdserve.planner.cost import CostModel  # noqa: E402
from pdserve.planner.hardware import GPU_PROFILES  # noqa: E402
from pdserve.planner.metrics import Slo  # noqa: E402
from pdserve.planner.model_spec import get_model  # noqa: E402
from pdserve.planner.layout import ClusterSpec, Layout  # noqa: E402
from pdserve.planner.simulator import Simulator  # noqa: E402
from pdserve.planner.synthetic import LengthMix, bursty_day  # noqa: E402

SLO = Slo(ttft_s=2.0, tpot_s=0.1)
LENGTHS = LengthMix(4000, 300, sigma=0.5, max_len=16000)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=1.0, help="mean requests/s over the day")
    ap.add_argument("--hours", type=float, default=24.0)
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "autoscale_day.png"))
    args = ap.parse_args()
    duration = args.hours * 3600
    reqs = bursty_day(args.rate, LENGTHS, duration_s=duration, seed=11)
    cost = CostModel(get_model("Llama-3.1-8B"), GPU_PROFILES["L40S"], 1)
    tokens_per_s = LENGTHS.prompt_mean / cost.prefill_s([(LENGTHS.prompt_mean, 0)])
    configs = {"prefill": pool_config("prefill", target=round(tokens_per_s * SLO.ttft_s / 2, -2), slo_s=SLO.ttft_s,
                                      max_replicas=8),
               "decode": pool_config("decode", target=0.7, slo_s=SLO.tpot_s, max_replicas=8)}
    driver = AutoscaleDriver(configs)
    t0 = time.process_time()
    result = Simulator(ClusterSpec(Layout(prefill=1, decode=1), cost, cost, startup_s=60.0), reqs, driver).run()
    cpu = time.process_time() - t0
    hist = {pool: np.array(rows) for pool, rows in result.pool_history.items()}
    gpu_hours = sum((h[1:, 0] - h[:-1, 0]) @ h[:-1, 1] for h in hist.values()) / 3600
    print(f"{len(reqs)} requests over {args.hours:g} h, simulated in {cpu:.1f} s CPU")
    print(f"SLO attainment (TTFT {SLO.ttft_s} s, TPOT {SLO.tpot_s} s): {result.attainment(SLO):.3f}; "
          f"failed {result.failed}; preemptions {result.preemptions}")
    print(f"GPU-hours {gpu_hours:.1f} (fixed at the peak: {(hist['prefill'][:, 1].max() + hist['decode'][:, 1].max()) * args.hours:.1f})")
    for pool, h in hist.items():
        print(f"{pool}: replicas min {h[:, 1].min():.0f} max {h[:, 1].max():.0f}, "
              f"changes {int((np.diff(h[:, 1]) != 0).sum())}")
    plot(result, hist, reqs, args, duration)


def plot(result, hist, reqs, args, duration: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(11, 8), sharex=True)
    arrivals = np.array([r.t for r in reqs])
    bins = np.arange(0, duration + 300, 300)
    counts, _ = np.histogram(arrivals, bins)
    for ax, pool in zip(axes[:2], ("prefill", "decode")):
        h = hist[pool]
        ax.step(h[:, 0] / 3600, h[:, 1], where="post", label=f"{pool} replicas", color="tab:blue")
        ax.set_ylabel("replicas")
        twin = ax.twinx()
        twin.plot(bins[:-1] / 3600, counts / 300, color="tab:gray", alpha=0.6, label="demand (req/s, 5 min)")
        twin.set_ylabel("req/s")
        ax.set_title(f"{pool} pool against demand")
        ax.legend(loc="upper left")
        twin.legend(loc="upper right")
    edges = np.arange(0, duration + 1800, 1800)
    ok = np.isfinite(result.finish) & (result.ttft <= SLO.ttft_s) & (result.tpot <= SLO.tpot_s)
    which = np.digitize(result.arrival, edges) - 1
    share = [ok[which == i].mean() if (which == i).any() else np.nan for i in range(len(edges) - 1)]
    axes[2].plot(edges[:-1] / 3600, share, marker=".")
    axes[2].axhline(0.9, color="tab:red", linestyle="--", label="90%")
    axes[2].set_ylim(0, 1.05)
    axes[2].set_ylabel("SLO attainment")
    axes[2].set_xlabel("hour of day")
    axes[2].legend(loc="lower left")
    fig.suptitle(f"Llama-3.1-8B on L40S, bursty day at {args.rate:g} req/s mean: built-in policies "
                 f"(attainment {result.attainment(SLO):.1%})")
    fig.tight_layout()
    fig.savefig(args.out, dpi=90)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
