"""The GPU bench's last step: ``OUT/summary.json`` and a short table of what BENCHMARKS.md
records, read from the phases' JSON files (any of them may be missing, failed or cut short),
with the issue's targets beside the figures they judge:

- the 8B decode step at batch 1, graphed, within 1.3x of its memory floor (the datasheet's);
- prefill MFU at 2k tokens of at least 40%;
- NIXL at 2 MiB blocks (the 8B geometry), in order, of at least 100 GB/s on one GPU.

    python -m benchmarks.gpu_bench.report OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PHASES = ("engine_8b", "nixl_vram", "served_smol", "served_8b")


def _rows(doc: dict | None, **match) -> list[dict]:
    rows = (doc or {}).get("rows", [])
    return [r for r in rows if "skipped" not in r and all(r.get(k) == v for k, v in match.items())]


def targets(docs: dict[str, dict | None]) -> dict:
    """Each target's figure (None where not measured) and whether it is met."""
    engine, nixl = docs.get("engine_8b"), docs.get("nixl_vram")
    decode = _rows(engine, what="decode", batch=1, cuda_graphs=True)
    prefill = _rows(engine, what="prefill", tokens=2048)  # graphed first, where it was
    reads = _rows(nixl, layout="in_order")
    same_tp, two_to_one = _rows(nixl, layout="by_head_1:1"), _rows(nixl, layout="by_head_2:1")
    mixed_graphed, mixed_eager = _rows(engine, what="mixed", piecewise=True), _rows(engine, what="mixed", cuda_graphs=False)
    first = min(decode, key=lambda r: r["context"]) if decode else None
    figures = {
        # the shortest context measured (1k): the step the weights dominate
        "decode_b1_graphed_over_floor": (first.get("step_over_floor") if decode else None, 1.3, "at most"),
        # the same step over what this device's own copy read (the datasheet's 4.8 TB/s is not
        # reached by any kernel: the H200's linears ran at 3.78 of its 3.93 TB/s measured)
        "decode_b1_graphed_over_measured_floor": (
            round(first["ms_per_step"] / first["floor_ms_measured_bw"], 2) if decode else None, 1.3, "at most"),
        "prefill_2k_mfu": (prefill[0].get("mfu") if prefill else None, 0.40, "at least"),
        # issue 56: the mixed step graphed (piecewise), against eager: below 1 is faster
        "mixed_step_graphed_over_eager": (
            round(mixed_graphed[0]["ms"] / mixed_eager[0]["ms"], 2) if mixed_graphed and mixed_eager else None,
            1.0, "at most"),
        "nixl_in_order_gb_per_s": (max((r["gb_per_s_median"] for r in reads), default=None), 100.0, "at least"),
        # prefill TP 2 to decode TP 1 over the same read between equal sizes (issue 56)
        "nixl_by_head_2to1_over_same_tp": (
            round(two_to_one[0]["gb_per_s_median"] / same_tp[0]["gb_per_s_median"], 2)
            if same_tp and two_to_one else None, 0.5, "at least"),
    }
    return {name: {"value": value, "target": f"{how} {goal:g}",
                   "met": None if value is None else (value <= goal if how == "at most" else value >= goal)}
            for name, (value, goal, how) in figures.items()}


def lines(docs: dict[str, dict | None]) -> list[str]:
    out = []
    for name in PHASES:
        doc = docs.get(name)
        out.append(f"{name}: {'missing' if doc is None else doc.get('status')}"
                   + (f" on {doc.get('device')}" if doc and doc.get("device") else ""))
    engine = docs.get("engine_8b")
    for r in _rows(engine, what="load"):
        out.append(f"  load {r['seconds']} s, peak/weights {r.get('peak_over_weights')}")
    for r in _rows(engine, what="decode"):
        out.append(f"  decode b{r['batch']} ctx{r['context']} {'graphs' if r['cuda_graphs'] else 'eager'}: "
                   f"{r['ms_per_step']} ms (floor {r.get('floor_ms_datasheet', r['floor_ms_measured_bw'])} ms)")
    for r in _rows(engine, what="step_profile"):
        classes = ", ".join(f"{k} {v}" for k, v in list(r["ms_by_class"].items())[:5])
        out.append(f"  profile b{r['batch']} ctx{r['context']} {'graphs' if r['cuda_graphs'] else 'eager'}: "
                   f"{r['kernels_per_step']} kernels ({r['kernels_per_layer']} a layer), busy {r['device_busy_ms']} of "
                   f"{r['profiled_step_ms']} ms: {classes}")
    for r in _rows(engine, what="prefill"):
        out.append(f"  prefill {r['tokens']} {'graphs' if r.get('cuda_graphs') else 'eager'}: {r['ms']} ms, "
                   f"MFU {r.get('mfu')}")
    for r in _rows(engine, what="mixed"):
        out.append(f"  mixed {r['rows']} rows + {r['chunk']} tokens at ctx{r['context']} "
                   f"{'piecewise graphs' if r['piecewise'] else 'eager'}: {r['ms']} ms")
    for r in _rows(docs.get("nixl_vram")):
        out.append(f"  nixl {r['blocks']} blocks {r['layout']}: {r['gb_per_s_median']} GB/s, "
                   f"{r['us_per_descriptor']} us/descriptor")
    for name in ("served_smol", "served_8b"):
        for r in _rows(docs.get(name)):
            p = lambda d: f"{d.get('p50') or 0:.1f}/{d.get('p99') or 0:.1f}"  # noqa: E731
            out.append(f"  {name} c{r['concurrency']}: TTFT {p(r['ttft_ms'])} TPOT {p(r['tpot_ms'])} "
                       f"ITL {p(r['itl_ms'])} ms (p50/p99), KV {r['kv_transfer_ms_per_request']} ms/request, "
                       f"{r['failed']} failed")
    return out


def main(argv: list[str] | None = None) -> int:
    out_dir = Path((argv or sys.argv[1:])[0])
    docs = {}
    for name in PHASES:
        try:
            docs[name] = json.loads((out_dir / f"{name}.json").read_text())
        except (OSError, ValueError):
            docs[name] = None
    summary = {"phases": {n: (d or {}).get("status", "missing") for n, d in docs.items()}, "targets": targets(docs),
               "lines": lines(docs)}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print("\n".join(summary["lines"]))
    for name, t in summary["targets"].items():
        print(f"  target {name}: {t['value']} ({t['target']}): {'n/a' if t['met'] is None else t['met']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
