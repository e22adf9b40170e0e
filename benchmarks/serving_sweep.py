"""Goodput of pdserve and vLLM, the way DistServe measures it (issue 45): `benchmarks/serving.py
--sweep` drives each server, one at a time and as serving.py starts them (pdserve as `make serve`,
so with `--layout auto`; vLLM on both cores), with `vllm bench serve` at a rising Poisson rate.

    .venv/bin/python benchmarks/serving.py --sweep                                  # both servers
    .venv/bin/python benchmarks/serving.py --sweep --servers pdserve --rates 0.5,1 --sweep-prompts 6
    .venv/bin/python benchmarks/serving.py --sweep --slo-ttft-ms 1000 --slo-tpot-ms 50
    .venv/bin/python benchmarks/serving.py --sweep --servers pdserve --pdserve-flags "--layout colocated" \
        --out-dir .bench/sweep-2c --sweep-plot .bench/sweep-2c/sweep.png     # a fixed layout, to compare
    .venv/bin/python benchmarks/serving.py --sweep --rerender                       # table, plot again

Per server: a warm-up run first (--warmup-prompts at the lowest rate, seed --seed, not
reported), then each rate of --rates with --sweep-prompts prompts of its own (seed --seed +
1000 x (its position + 1), as benchmarks/goodput.py seeds its rates: no rate finds another's
prompts in a prefix cache, and both servers get the same prompts at each rate), no warm-up
requests inside a rate (vLLM's warm-up request is the run's first prompt, which would then be
cached), then a saturation run (--saturation-concurrency requests in flight, rate inf). vLLM
runs at its best dtype on this processor unless --vllm-dtype says otherwise. Every run passes
`--goodput ttft:MS tpot:MS`; vLLM's own figure is kept beside the sweep's attainment, which is
computed from the per-request detail (benchmarks/serving_sweep_report.py has the rule for
attainment and goodput, and how goodput is (not) interpolated).

Outputs (--out-dir): sweep.json ("pdserve-serving-sweep/1": machine, workload, slo, rates,
servers, rows: [{server, load, rate (null: saturation), seed, the serving benchmark's row fields,
requests, met, failed, attainment (null: the run gave no result; then error), vllm_request_goodput}],
summary: {servers: {SERVER: {goodput: {req_s, interpolated_req_s, how}, saturation}}, ratios},
pdserve_layout: the layout lines of pdserve's log, --layout auto's candidates and choice),
sweep.md, the raw `vllm bench serve` files and logs; the plot goes to --sweep-plot.
A server that fails keeps what it measured; its runs left are rows without a result, and the
next server still runs.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks import processor
from benchmarks.goodput import RATE_SEED_STRIDE
from benchmarks.serving_procs import ServerError
from benchmarks.serving_run import (ROOT, Load, check_prerequisites, new_doc, pdserve_server, run_server,
                                    vllm_server)
from benchmarks.serving_sweep_report import SATURATION, markdown, plot, summarize, sweep_row

SCHEMA = "pdserve-serving-sweep/1"
WARMUP = "warmup"


def add_sweep_arguments(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("--sweep (goodput against rate; benchmarks/serving_sweep.py)")
    g.add_argument("--sweep", action="store_true", help="a rate sweep of each server instead of the two fixed loads")
    g.add_argument("--rates", default="0.5,1,1.5,2", help="comma-separated Poisson rates, req/s")
    g.add_argument("--sweep-prompts", type=int, default=48, help="prompts per rate")
    g.add_argument("--warmup-prompts", type=int, default=8, help="the unreported warm-up run's prompts")
    g.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="the TTFT objective")
    g.add_argument("--slo-tpot-ms", type=float, default=100.0, help="the TPOT objective")
    g.add_argument("--saturation-concurrency", type=int, default=16, help="requests in flight in the saturation run "
                   "(0: no saturation run)")
    g.add_argument("--saturation-prompts", type=int, default=48)
    g.add_argument("--sweep-plot", type=Path, default=ROOT / "docs" / "benchmarks" / "serving_sweep.png")
    g.add_argument("--pdserve-flags", default="", help="more `pdserve serve` flags, e.g. '--layout colocated': "
                   "sweep each fixed layout beside --layout auto's choice (default: none, as `make serve`)")


def best_vllm_dtype(kernel_path: str | None) -> str:
    """vLLM-CPU's fastest dtype: bfloat16 needs AVX-512 BF16 or AMX (on AVX2 only it ran 3x slower
    than float32, issue 45's table)."""
    return "float32" if kernel_path in (None, "avx2") else "bfloat16"


def sweep_loads(args) -> list[Load]:
    """The warm-up, each rate with its own seed, and the saturation run, in order."""
    loads = [Load(WARMUP, f"warm-up, {args.warmup_prompts} prompts at {args.rates[0]:g} req/s",
                  args.warmup_prompts, args.rates[0], None, seed=args.seed, warmups=0)]
    for i, rate in enumerate(args.rates):
        loads.append(Load(f"rate{rate:g}", f"{rate:g} req/s, {args.sweep_prompts} prompts", args.sweep_prompts,
                          rate, None, seed=args.seed + RATE_SEED_STRIDE * (i + 1), warmups=0))
    if args.saturation_concurrency:
        loads.append(Load(SATURATION, f"concurrency {args.saturation_concurrency}, {args.saturation_prompts} prompts",
                          args.saturation_prompts, None, args.saturation_concurrency,
                          seed=args.seed + RATE_SEED_STRIDE * (len(args.rates) + 1), warmups=0))
    return loads


def rows_of(doc: dict, args, loads: list[Load]) -> list[dict]:
    """The sweep's rows from the serving benchmark's results (their raw files), one per server
    and load but the warm-up; a load without a result is a row saying why."""
    rows = []
    for server in doc["servers_run"]:
        for load in loads[1:]:
            r = next((x for x in doc["results"] if x["server"] == server and x["load"] == load.name), None)
            if r is None:
                rows.append({"server": server, "load": load.name, "rate": load.request_rate, "seed": load.seed,
                             "attainment": None, "error": doc["errors"].get(server, "not run")})
                continue
            raw = json.loads((args.out_dir / r["raw_result"]).read_text())
            rows.append({**sweep_row(server, load.name, load.request_rate, load.seed, raw,
                                     args.slo_ttft_ms, args.slo_tpot_ms), "cpu": r["cpu"], "raw_result": r["raw_result"]})
    return rows


def layout_lines(log: Path) -> list[str]:
    """What `pdserve serve` said about its layout (``--layout auto``: the candidates and its choice)."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return [line.removeprefix("pdserve: ") for line in text.splitlines() if line.startswith("pdserve: layout")]


def finish(doc: dict, args) -> None:
    doc["summary"] = summarize(doc["rows"])
    (args.out_dir / "sweep.json").write_text(json.dumps(doc, indent=2) + "\n")
    table = markdown(doc)
    (args.out_dir / "sweep.md").write_text(table + "\n")
    plot(doc, args.sweep_plot)
    print("\n" + table)
    print(f"\nwrote {args.out_dir / 'sweep.json'}, {args.out_dir / 'sweep.md'} and {args.sweep_plot}")


def parse_rates(text: str) -> list[float]:
    try:
        rates = sorted({float(r) for r in text.split(",") if r.strip()})
    except ValueError:
        raise SystemExit(f"--rates: {text!r} is not comma-separated numbers") from None
    if not rates or rates[0] <= 0:
        raise SystemExit("--rates: needs at least one rate, each > 0")
    return rates


def main(args) -> None:
    args.rates = parse_rates(args.rates)
    if args.rerender:
        doc = json.loads((args.out_dir / "sweep.json").read_text())
        return finish(doc, args)
    machine = processor.describe()
    args.vllm_dtype = args.vllm_dtype or best_vllm_dtype(machine.get("kernel_path"))
    check_prerequisites(args)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    args.loads = loads = sweep_loads(args)
    doc = {**new_doc(args), "schema": SCHEMA, "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
           "rates": args.rates, "vllm_dtype": args.vllm_dtype, "servers_run": args.servers, "errors": {}}
    t0 = time.monotonic()

    def step(msg: str) -> None:
        print(f"\n[sweep {time.monotonic() - t0:5.0f} s] {msg}", flush=True)

    makers = {"pdserve": pdserve_server, "vllm": vllm_server}
    print(f"[sweep] {', '.join(args.servers)}, one at a time: a warm-up, {len(args.rates)} rates"
          f"{', a saturation run' if args.saturation_concurrency else ''}; vLLM in {args.vllm_dtype}; "
          f"output in {args.out_dir}", flush=True)
    for name in args.servers:
        try:
            run_server(args, makers[name](args), step, doc)
        except ServerError as exc:  # what it measured stays; the next server still runs
            doc["errors"][name] = str(exc)
            step(f"{name}: failed: {exc}")
        if name == "pdserve":
            doc["pdserve_layout"] = layout_lines(args.out_dir / "pdserve_server.log")
    doc["rows"] = rows_of(doc, args, loads)
    finish(doc, args)
