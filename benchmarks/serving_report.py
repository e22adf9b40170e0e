"""The serving benchmark's results (benchmarks/serving.py): read from `vllm bench serve`'s
`--save-result` files, compared, checked against issue 9's targets, and written as a table and a
plot. Pure functions over plain dicts, except the plot; the results schema is in serving.py's
module docstring.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.load.metrics import percentile

METRICS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (50, 90, 99)
SERVERS = ("pdserve", "vllm")
SERVER_LABELS = {"pdserve": "pdserve (make serve)", "vllm": "vLLM CPU (both cores)"}
SERVER_COLORS = {"pdserve": "tab:blue", "vllm": "tab:orange"}


class ResultError(ValueError):
    """A `vllm bench serve` result lacks a field this report needs."""


def record(server: str, load: str, raw: dict) -> dict:
    """One row of the results file from one `vllm bench serve --save-result` JSON."""
    def need(key: str) -> float:
        if raw.get(key) is None:
            raise ResultError(f"{server}/{load}: the vllm bench result has no '{key}' "
                              f"(run with --percentile-metrics {','.join(METRICS)} "
                              f"--metric-percentiles {','.join(map(str, PERCENTILES))})")
        return float(raw[key])

    completed = int(need("completed"))
    failed = int(raw.get("failed", raw.get("num_prompts", completed) - completed))
    row = {"server": server, "load": load, "completed": completed, "failed": failed,
           "valid": completed > 0 and failed == 0,  # with failures, latencies and rates describe another load
           "duration_s": need("duration"), "req_s": need("request_throughput"),
           "output_tok_s": need("output_throughput")}
    for m in METRICS:
        row[f"{m}_ms"] = {"mean": need(f"mean_{m}_ms"), **{f"p{p}": need(f"p{p}_{m}_ms") for p in PERCENTILES}}
    row.update(itl_split(raw.get("itls")))
    return row


def itl_split(itls: list[list[float]] | None) -> dict:
    """With per-request detail (--save-detailed): each stream's first inter-token gap (first
    to second token: for pdserve the KV hand-off to the decode worker) apart from its others."""
    if not itls:
        return {}
    first = [x[0] * 1e3 for x in itls if x]
    rest = [y * 1e3 for x in itls for y in x[1:]]
    return {"second_token_gap_ms": _percentiles(first), "steady_itl_ms": _percentiles(rest)}


def _percentiles(values: list[float]) -> dict:
    return {f"p{p}": round(percentile(values, p), 1) for p in PERCENTILES} if values else {}


def find(results: list[dict], server: str, load: str) -> dict | None:
    return next((r for r in results if r["server"] == server and r["load"] == load), None)


def compare(results: list[dict], loads: list[str]) -> dict:
    """pdserve / vLLM per load: TTFT p50, TPOT p50, ITL p99 and output-throughput ratios (None where a
    server did not run, or a request failed: then neither side served the load as offered)."""
    out = {}
    for load in loads:
        ours, peer = find(results, "pdserve", load), find(results, "vllm", load)
        if ours is None or peer is None or not (ours["valid"] and peer["valid"]):
            out[load] = {"ttft_p50": None, "tpot_p50": None, "itl_p99": None, "output_tok_s": None}
            continue
        out[load] = {"ttft_p50": _ratio(ours["ttft_ms"]["p50"], peer["ttft_ms"]["p50"]),
                     "tpot_p50": _ratio(ours["tpot_ms"]["p50"], peer["tpot_ms"]["p50"]),
                     "itl_p99": _ratio(ours["itl_ms"]["p99"], peer["itl_ms"]["p99"]),
                     "output_tok_s": _ratio(ours["output_tok_s"], peer["output_tok_s"])}
    return out


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


# Issue 24, on every kind of processor: at 2 req/s, TPOT p50 at most vLLM's, TTFT p50 at most
# 1.5x vLLM's and ITL p99 at most half of vLLM's; at concurrency 16, output tokens/s at least
# vLLM's. (name, load, ratio key, bound, "max" or "min")
TARGETS = (
    ("TPOT p50 at most vLLM's", "rate2", "tpot_p50", 1.0, "max"),
    ("TTFT p50 at most 1.5x vLLM's", "rate2", "ttft_p50", 1.5, "max"),
    ("ITL p99 at most half of vLLM's", "rate2", "itl_p99", 0.5, "max"),
    ("output tok/s at least vLLM's", "conc16", "output_tok_s", 1.0, "min"),
)


def targets(ratios: dict) -> list[dict]:
    """Each target with its measured ratio and met: True / False, or None when not measured."""
    rows = []
    for name, load, key, bound, kind in TARGETS:
        ratio = ratios.get(load, {}).get(key)
        met = None if ratio is None else (ratio <= bound if kind == "max" else ratio >= bound)
        rows.append({"target": name, "load": load, "ratio": key, "bound": bound, "kind": kind,
                     "value": ratio, "met": met})
    return rows


def markdown(doc: dict) -> str:
    """The results table, the ratio table and the targets, as BENCHMARKS.md shows them."""
    loads = doc["loads"]
    machine = doc["machine"]
    lines = [f"Processor: {machine.get('cpu_model', '?')}, {machine.get('cpus', '?')} cpus, flags "
             f"{' '.join(machine.get('flags', [])) or '?'}; pdserve kernel path {machine.get('kernel_path') or '?'}"
             + (f"; oneDNN capped at {machine['onednn_max_isa']} (an emulation)" if machine.get("onednn_max_isa") else "")
             + ".", "",
             "| server | load | done / failed | req/s | out tok/s | TTFT p50 / p90 / p99 ms | "
             "TPOT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms | E2EL p50 / p90 / p99 ms | server busy cores |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["results"]:
        cells = [" / ".join(f"{r[f'{m}_ms'][f'p{p}']:.{0 if m in ('ttft', 'e2el') else 1}f}" for p in PERCENTILES)
                 for m in METRICS]
        lines.append(f"| {SERVER_LABELS.get(r['server'], r['server'])} | {loads[r['load']]['label']} | "
                     f"{r['completed']} / {r['failed']} | {r['req_s']:.2f} | {r['output_tok_s']:.1f} | "
                     + " | ".join(cells) + f" | {_cores(r)} |")
    lines += ["", "| load | TTFT p50 pdserve / vLLM | TPOT p50 pdserve / vLLM | ITL p99 pdserve / vLLM | "
              "out tok/s pdserve / vLLM |", "|---|---|---|---|---|"]
    for load, r in doc["ratios"].items():
        lines.append(f"| {loads[load]['label']} | "
                     + " | ".join(_x(r.get(k)) for k in ("ttft_p50", "tpot_p50", "itl_p99", "output_tok_s")) + " |")
    split = [r for r in doc["results"] if r.get("second_token_gap_ms")]
    if split:
        lines += ["", "| server | load | first-to-second-token gap p50 / p90 / p99 ms | the other ITLs p50 / p90 / p99 ms |",
                  "|---|---|---|---|"]
        for r in split:
            lines.append(f"| {SERVER_LABELS.get(r['server'], r['server'])} | {loads[r['load']]['label']} | "
                         + " | ".join(" / ".join(f"{r[k].get(f'p{p}', float('nan')):.1f}" for p in PERCENTILES)
                                      for k in ("second_token_gap_ms", "steady_itl_ms")) + " |")
    lines += ["", "| target | load | pdserve / vLLM | bound | met |", "|---|---|---|---|---|"]
    for t in doc["targets"]:
        if t["load"] not in loads:  # a run of some loads only (--loads): that target was not measured
            continue
        met = "n/a" if t["met"] is None else ("**met**" if t["met"] else "**not met**")
        bound = f"{'≤' if t['kind'] == 'max' else '≥'} {t['bound']:g}x"
        lines.append(f"| {t['target']} | {loads[t['load']]['label']} | {_x(t['value'])} | {bound} | {met} |")
    return "\n".join(lines)


def _cores(r: dict) -> str:
    cores = (r.get("cpu") or {}).get("server_cores")
    return "—" if cores is None else f"{cores:.2f}"


def _x(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}x"


def plot(doc: dict, path: Path) -> None:
    """Bars per load: TTFT p50, TPOT p50 and output tok/s, pdserve beside vLLM (valid runs only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("TTFT p50 (ms)", lambda r: r["ttft_ms"]["p50"]), ("TPOT p50 (ms)", lambda r: r["tpot_ms"]["p50"]),
              ("output tok/s", lambda r: r["output_tok_s"]))
    loads = list(doc["loads"])
    fig, axes = plt.subplots(1, len(panels), figsize=(12, 4))
    width = 0.38
    for ax, (title, value) in zip(axes, panels):
        for i, server in enumerate(SERVERS):
            xs, ys = [], []
            for j, load in enumerate(loads):
                r = find(doc["results"], server, load)
                if r is not None and r.get("valid", True):  # a load with failures has no bar
                    xs.append(j + (i - 0.5) * width)
                    ys.append(value(r))
            if not ys:
                continue
            bars = ax.bar(xs, ys, width, label=SERVER_LABELS[server], color=SERVER_COLORS[server])
            ax.bar_label(bars, fmt="%.0f", fontsize=8)
        ax.set_xticks(range(len(loads)), [doc["loads"][l]["label"].replace(", ", "\n") for l in loads])
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    machine = doc["machine"]
    fig.suptitle(f"vllm bench serve, random {doc['workload']['input_len']} in / {doc['workload']['output_len']} "
                 f"out, {machine['cpus']} shared CPU cores of {machine.get('cpu_model', '?')} "
                 f"(pdserve kernel path {machine.get('kernel_path') or '?'}"
                 + (f", oneDNN capped at {machine['onednn_max_isa']}" if machine.get("onednn_max_isa") else "")
                 + f"; {doc['created'][:16]} UTC)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# Innermost frames where a thread sits blocked (py-spy cannot always tell a blocked thread from a
# running one, so these are named): lock and event waits, selector polls, Ray's task loop.
WAITS = ("Condition.wait", "Event.wait", "EpollSelector.select", "_PollLikeSelector.select",
         "SelectSelector.select", "Worker.main_loop", "Queue.get", "sleep")


def profile_summary(raw: Path, top: int = 12) -> dict:
    """From py-spy's raw collapsed stacks ('frame;frame;... count' per line; a frame is
    'function (file:line)'): where the busy samples are. Samples whose innermost function is a
    wait (WAITS) count as waiting and are left out of the rest. 'self': the innermost frame,
    'inclusive': every function on the stack once per sample; both as (frame, share of busy
    samples), largest first, leaving out frames in nearly every busy sample (entry points)."""
    inclusive: dict[str, int] = {}
    leaf: dict[str, int] = {}
    samples = waiting = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n, frames = int(count), stack.split(";")
        samples += n
        if frames[-1].split(" (")[0] in WAITS:
            waiting += n
            continue
        leaf[frames[-1]] = leaf.get(frames[-1], 0) + n
        for frame in set(frames):
            inclusive[frame] = inclusive.get(frame, 0) + n
    busy = samples - waiting

    def ranked(counts: dict[str, int], cap: float) -> list[tuple[str, float]]:
        shares = sorted(((f, n / busy) for f, n in counts.items()), key=lambda x: -x[1])
        return [(f, round(s, 4)) for f, s in shares if s < cap][:top]

    return {"samples": samples, "waiting_share": round(waiting / samples, 4) if samples else None,
            "self": ranked(leaf, 1.01) if busy else [], "inclusive": ranked(inclusive, 0.98) if busy else []}
