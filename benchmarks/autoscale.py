"""Records an autoscaling run and plots each pool's load and replicas over time.

    .venv/bin/python benchmarks/autoscale.py          # ~3 minutes; writes autoscale_run.png

A local cluster starts at 1 prefill + 1 decode worker with fast autoscaling settings (windows
and cooldowns of seconds). Three phases: long prompts with short outputs, then short prompts
with long outputs, then no load. The plot shows each pool's signal (queued prompt tokens;
KV usage) against its scale-up line, and each pool's replicas.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pdserve.cluster.autoscaling import pool_config  # noqa: E402
from pdserve.cluster.config import ClusterConfig  # noqa: E402
from pdserve.cluster.local import LocalCluster  # noqa: E402
from pdserve.engine.config import CacheConfig, EngineConfig  # noqa: E402
from tests.helpers.autoscale_load import FAST, send_load  # noqa: E402


def plot(cluster: LocalCluster, t0: float, phases: list[tuple[str, float, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for ax, pool, signal, label in ((axes[0], "prefill", "queued_prompt_tokens", "queued prompt tokens"),
                                    (axes[1], "decode", "kv_usage", "KV usage (0-1)")):
        samples = cluster.autoscaler.traces[pool].samples
        cfg = cluster.config.autoscaling[pool]
        t = [s.t - t0 for s in samples]
        ax.plot(t, [getattr(s, signal) for s in samples], color="tab:blue", label=label)
        ax.axhline(cfg.target * cfg.scale_up_threshold, color="tab:blue", ls=":", lw=1,
                   label="scale-up line (per worker)")
        ax.set_ylabel(label)
        twin = ax.twinx()
        twin.step(t, [s.replicas for s in samples], where="post", color="tab:red", label="replicas")
        twin.set_ylabel("replicas", color="tab:red")
        twin.set_ylim(0, cfg.max_replicas + 0.5)
        ax.set_title(f"{pool} pool")
        for name, start, end in phases:
            ax.axvspan(start - t0, end - t0, alpha=0.08, color="gray")
            ax.text((start + end) / 2 - t0, ax.get_ylim()[1] * 0.9, name, ha="center", fontsize=8)
        ax.legend(loc="upper left", fontsize=8)
    axes[1].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    from benchmarks.processor import print_banner

    print_banner()  # the processor and kernel path every figure below ran on
    config = ClusterConfig(
        engine=EngineConfig(cache=CacheConfig(memory_budget_bytes=96 << 20)), grpc_port=0, http_port=None,
        threads_per_worker=1, autoscale_interval_s=0.5,
        autoscaling={"prefill": pool_config("prefill", target=300, **FAST),
                     "decode": pool_config("decode", target=0.5, **FAST)})
    cluster = LocalCluster(config)
    phases = []
    try:
        cluster.start()
        t0 = time.monotonic()
        for name, kwargs in (("long prompts", dict(n=24, every_s=0.6, prompt_len=600)),
                             ("long outputs", dict(n=14, every_s=0.3, prompt_len=30, max_tokens=200))):
            start = time.monotonic()
            counts = asyncio.run(send_load(cluster.address, **kwargs))
            phases.append((name, start, time.monotonic()))
            print(f"{name}: {len(counts)} requests, all complete: {len(set(counts)) == 1}", flush=True)
        start = time.monotonic()
        while time.monotonic() - start < 40 and (len(cluster.prefill) > 1 or len(cluster.decode) > 1):
            time.sleep(1)
        time.sleep(3)
        phases.append(("idle", start, time.monotonic()))
        for pool in ("prefill", "decode"):
            changes = [d.action for d in cluster.autoscaler.traces[pool].decisions if d.action != "hold"]
            print(pool, "changes:", changes)
        path = ROOT / "docs" / "benchmarks" / "autoscale_run.png"
        plot(cluster, t0, phases, path)
        print(f"wrote {path}")
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
