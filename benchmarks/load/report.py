"""What a run leaves behind: the results JSON, a PNG of its latency distributions and of
its throughput over time, and a one-screen text summary."""

from __future__ import annotations

from pathlib import Path

from benchmarks.load.metrics import itls, tpot, ttft
from benchmarks.load.runner import Results


def write_json(results: Results, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(results.to_json() + "\n")
    return path


def _cdf(ax, values_ms: list[float], title: str, slo_ms: float | None) -> None:
    xs = sorted(values_ms)
    ax.plot(xs[:1] + xs, [0.0] + [(i + 1) / len(xs) for i in range(len(xs))], drawstyle="steps-post")
    if slo_ms is not None:
        ax.axvline(slo_ms, color="tab:red", linestyle="--", label=f"SLO {slo_ms:g} ms")
        ax.legend(loc="lower right")
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of samples")
    ax.grid(alpha=0.3)


def plot(results: Results, path: Path, title: str | None = None) -> Path:
    """TTFT, TPOT and ITL CDFs (with the SLO where one is set) and output tokens per second
    over the run in one-second bins."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in results.records if r.ok]
    slo = results.spec.slo
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    _cdf(axes[0, 0], [ttft(r) * 1000 for r in done], "TTFT", slo.ttft_ms if slo else None)
    _cdf(axes[0, 1], [p * 1000 for p in map(tpot, done) if p is not None], "TPOT", slo.tpot_ms if slo else None)
    _cdf(axes[1, 0], [g * 1000 for r in done for g in itls(r)], "ITL (between streamed chunks)", None)
    ax = axes[1, 1]
    width = max(0.1, results.summary.duration_s / 60)  # about 60 bins, none under 0.1 s
    bins = int(results.summary.duration_s / width) + 1
    rate = [0.0] * bins
    for r in done:  # a request's tokens spread evenly over its chunks
        share = r.output_tokens / len(r.chunk_times) / width
        for t in r.chunk_times:
            rate[min(int(t / width), bins - 1)] += share
    ax.bar([i * width for i in range(bins)], rate, width=width, align="edge")
    ax.set_title(f"output tokens per second ({width:.2g} s bins)")
    ax.set_xlabel("s since start")
    ax.grid(alpha=0.3)
    s = results.summary
    fig.suptitle(title or f"{results.model} @ {results.base_url}: {s.completed} ok, {s.failed} failed, "
                          f"{s.req_s:.2f} req/s, {s.output_tok_s:.0f} output tok/s")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def text(results: Results) -> str:
    s = results.summary
    lines = [f"requests: {s.completed} completed, {s.failed} failed in {s.duration_s:.1f} s",
             f"throughput: {s.req_s:.2f} req/s, {s.output_tok_s:.1f} output tok/s, {s.prompt_tok_s:.1f} prompt tok/s"]
    for name, d in (("TTFT", s.ttft_ms), ("TPOT", s.tpot_ms), ("ITL", s.itl_ms), ("E2EL", s.e2el_ms)):
        lines.append(f"{name:>5} ms: mean {d['mean']:8.1f}  p50 {d['p50']:8.1f}  p90 {d['p90']:8.1f}  "
                     f"p99 {d['p99']:8.1f}")
    if results.spec.slo:
        slo = results.spec.slo
        lines.append(f"goodput: {s.goodput_req_s:.2f} req/s meet TTFT <= {slo.ttft_ms:g} ms and TPOT <= "
                     f"{slo.tpot_ms:g} ms ({100 * s.slo_attainment:.0f}% of requests)")
    return "\n".join(lines)
