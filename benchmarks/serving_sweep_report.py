"""The serving sweep's arithmetic (``benchmarks/serving.py --sweep``, issue 45): SLO attainment per
rate from `vllm bench serve`'s per-request detail, goodput per server, throughput at saturation,
the pdserve/vLLM ratios, the table and the plot. Pure functions over plain dicts, except the plot.

Attainment at a rate: the share of the requests sent that met both objectives, TTFT <= the TTFT
objective and TPOT <= the TPOT objective, TPOT as vLLM computes it for its own ``--goodput``
((latency - TTFT) / (output tokens - 1), 0 for a one-token answer). A failed request meets
neither: it counts in the denominator.

Goodput of a server: the highest swept rate at which attainment is at least ``TARGET`` (90%)
and at every lower swept rate, read off the sweep, not interpolated: a rate that misses ends the
search, so a noisy pass at a higher rate after a miss does not count. Beside it, for reference,
``interpolated_req_s``: where attainment crosses 90% on the straight line between the last rate
that met it and the first that did not (DistServe's ``find_intersection``), the swept goodput's
upper bound at this resolution. A rate whose run produced no result stops the search there too
(``how`` says so); every swept rate met: the highest is a lower bound (``how`` says so).
"""

from __future__ import annotations

import math

from pathlib import Path

from benchmarks.serving_report import SERVER_COLORS, SERVER_LABELS, SERVERS, record

TARGET = 0.9  # DistServe's attainment for goodput
SATURATION = "saturation"  # the load name of the max-concurrency run


def attainment(raw: dict, ttft_ms: float, tpot_ms: float) -> dict:
    """{requests, met, failed, attainment} of one `vllm bench serve --save-detailed` result."""
    ttfts, latencies, out_lens = raw.get("ttfts"), raw.get("latencies"), raw.get("output_lens")
    if ttfts is None or latencies is None or out_lens is None:
        raise ValueError("the vllm bench result has no per-request detail (ttfts, latencies, output_lens): "
                         "run it with --save-detailed")
    errors = raw.get("errors") or [""] * len(ttfts)
    met = failed = 0
    for ttft, latency, n, error in zip(ttfts, latencies, out_lens, errors):
        if error or ttft is None or not n:
            failed += 1
            continue
        tpot = (latency - ttft) / (n - 1) if n > 1 else 0.0
        met += ttft * 1e3 <= ttft_ms and tpot * 1e3 <= tpot_ms
    return {"requests": len(ttfts), "met": met, "failed": failed,
            "attainment": met / len(ttfts) if ttfts else None}


def sweep_row(server: str, load: str, rate: float | None, seed: int, raw: dict, ttft_ms: float,
              tpot_ms: float) -> dict:
    """One run of the sweep (a rate, or the saturation run with ``rate`` None): the serving
    benchmark's row (percentiles, req/s) with the attainment and vLLM's own goodput figure."""
    row = record(server, load, raw)
    return {**row, "rate": rate, "seed": seed, **attainment(raw, ttft_ms, tpot_ms),
            "vllm_request_goodput": raw.get("request_goodput")}


def goodput(rows: list[dict], target: float = TARGET) -> dict:
    """{req_s, interpolated_req_s, how} of one server's swept rows (any order; a row with
    ``attainment`` None is a run without a result)."""
    swept = sorted((r for r in rows if r.get("rate") is not None), key=lambda r: r["rate"])
    if not swept:
        return {"req_s": None, "interpolated_req_s": None, "how": "no rate ran"}
    best = None
    for r in swept:
        if r.get("attainment") is None:
            return {"req_s": best and best["rate"], "interpolated_req_s": None,
                    "how": f"the run at {r['rate']:g} req/s has no result: nothing is claimed from there up"}
        if r["attainment"] < target:
            if best is None:
                return {"req_s": 0.0, "interpolated_req_s": None,
                        "how": f"below the lowest swept rate ({r['rate']:g} req/s met {pct(r['attainment'])})"}
            x0, y0, x1, y1 = best["rate"], best["attainment"], r["rate"], r["attainment"]
            crossing = x0 + (y0 - target) * (x1 - x0) / (y0 - y1) if y0 > y1 else x0
            return {"req_s": x0, "interpolated_req_s": round(crossing, 3),
                    "how": f"{x0:g} req/s met {pct(y0)}, {x1:g} req/s {pct(y1)}"}
        best = r
    return {"req_s": best["rate"], "interpolated_req_s": None,
            "how": f"every swept rate met {target:.0%}: at least {best['rate']:g} req/s"}


def pct(share: float) -> str:
    """A share as a percentage cut (not rounded) to one decimal: 43 of 48 is 89.5%, never a
    "90%" that reads as meeting a 90% target it missed."""
    return f"{math.floor(share * 1000 + 1e-9) / 10:g}%"


def ratio(ours: float | None, peer: float | None) -> float | None:
    """pdserve / vLLM; None where either is missing or vLLM's is 0."""
    return round(ours / peer, 3) if ours is not None and peer else None


def summarize(rows: list[dict], servers: tuple[str, ...] = SERVERS) -> dict:
    """{"servers": {server: {goodput, saturation}}, "ratios": {goodput, saturation_req_s,
    saturation_output_tok_s}} of a sweep's rows."""
    out: dict = {}
    for s in servers:
        mine = [r for r in rows if r["server"] == s]
        sat = next((r for r in mine if r["load"] == SATURATION and r.get("attainment") is not None), None)
        out[s] = {"goodput": goodput(mine), "saturation": None if sat is None else
                  {"req_s": sat["req_s"], "output_tok_s": sat["output_tok_s"], "completed": sat["completed"],
                   "failed": sat["failed"]}}
    ours, peer = out.get("pdserve", {}), out.get("vllm", {})

    def sat(side: dict, key: str) -> float | None:
        return (side.get("saturation") or {}).get(key)

    return {"servers": out, "ratios": {
        "goodput": ratio((ours.get("goodput") or {}).get("req_s"), (peer.get("goodput") or {}).get("req_s")),
        "saturation_req_s": ratio(sat(ours, "req_s"), sat(peer, "req_s")),
        "saturation_output_tok_s": ratio(sat(ours, "output_tok_s"), sat(peer, "output_tok_s"))}}


def _cell(r: dict | None) -> str:
    if r is None:
        return "— | — | — | — | —"
    if r.get("attainment") is None:
        return f"no result ({r.get('error', 'failed')}) | — | — | — | —"
    return (f"{pct(r['attainment'])} ({r['met']}/{r['requests']}) | {r['ttft_ms']['p50']:.0f} / {r['ttft_ms']['p99']:.0f} | "
            f"{r['tpot_ms']['p50']:.1f} / {r['tpot_ms']['p99']:.1f} | {r['itl_ms']['p99']:.0f} | {r['req_s']:.2f}")


def _num(v: float | None, fmt: str) -> str:
    return "—" if v is None else format(v, fmt)


def _x(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}x"


def markdown(doc: dict) -> str:
    """Per rate, each server's attainment, TTFT and TPOT p50 / p99, ITL p99 and req/s; then
    goodput and throughput at saturation per server, and pdserve / vLLM."""
    slo, servers = doc["slo"], [s for s in SERVERS if s in doc["servers_run"]]
    head = " | ".join(f"{s}: attainment | TTFT p50 / p99 ms | TPOT p50 / p99 ms | ITL p99 ms | req/s" for s in servers)
    lines = [f"Objectives: TTFT <= {slo['ttft_ms']:g} ms and TPOT <= {slo['tpot_ms']:g} ms; goodput: the highest "
             f"swept rate with at least {TARGET:.0%} of requests meeting both (not interpolated).", "",
             f"| rate req/s | {head} |", "|---|" + "---|" * (5 * len(servers))]
    by = {(r["server"], r.get("rate")): r for r in doc["rows"] if r["load"] != SATURATION}
    for rate in sorted({r["rate"] for r in doc["rows"] if r.get("rate") is not None}):
        lines.append(f"| {rate:g} | " + " | ".join(_cell(by.get((s, rate))) for s in servers) + " |")
    summary = doc["summary"]
    lines += ["", "| server | goodput req/s | crossing 90% (interpolated) | how | saturation req/s | saturation out tok/s |",
              "|---|---|---|---|---|---|"]
    for s in servers:
        g, sat = summary["servers"][s]["goodput"], summary["servers"][s]["saturation"] or {}
        lines.append(f"| {SERVER_LABELS.get(s, s)} | {_num(g['req_s'], 'g')} | {_num(g['interpolated_req_s'], '.2f')} | "
                     f"{g['how']} | {_num(sat.get('req_s'), '.2f')} | {_num(sat.get('output_tok_s'), '.1f')} |")
    r = summary["ratios"]
    lines += ["", f"pdserve / vLLM: goodput {_x(r['goodput'])}, throughput at saturation {_x(r['saturation_req_s'])} "
                  f"req/s, {_x(r['saturation_output_tok_s'])} output tok/s."]
    chose = [line for line in doc.get("pdserve_layout", []) if "chose" in line or "given" in line or "default" in line]
    if chose:
        lines += ["", f"pdserve's layout: {chose[-1]}"]
    return "\n".join(lines)


def plot(doc: dict, path: Path) -> None:
    """Attainment against rate, one line per server, with the 90% line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in SERVERS:
        pts = sorted((r["rate"], 100 * r["attainment"]) for r in doc["rows"]
                     if r["server"] == s and r.get("rate") is not None and r.get("attainment") is not None)
        if pts:
            g = doc["summary"]["servers"][s]["goodput"]["req_s"]
            ax.plot(*zip(*pts), marker="o", color=SERVER_COLORS[s],
                    label=f"{SERVER_LABELS[s]}: goodput {_num(g, 'g')} req/s")
    ax.axhline(100 * TARGET, color="grey", linestyle=":", linewidth=1)
    ax.set_ylim(0, 105)
    ax.set_xlabel("request rate (req/s, Poisson)")
    ax.set_ylabel("% of requests meeting TTFT and TPOT objectives")
    machine, slo = doc["machine"], doc["slo"]
    ax.set_title(f"{machine.get('cpu_model', '?')} ({machine.get('kernel_path') or '?'}), "
                 f"TTFT <= {slo['ttft_ms']:g} ms, TPOT <= {slo['tpot_ms']:g} ms", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
