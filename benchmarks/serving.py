"""Serving benchmark (issue 9): pdserve as `make serve` starts it against vLLM's CPU build, both
driven by vLLM's own load generator, `vllm bench serve`, in one run; one server at a time.

    bash benchmarks/peers/setup_vllm.sh                    # vLLM's venv: the peer and the load generator
    .venv/bin/python benchmarks/serving.py                 # ~8 min: pdserve, then vLLM
    .venv/bin/python benchmarks/serving.py --profile       # + a py-spy profile of each pdserve worker
    .venv/bin/python benchmarks/serving.py --servers pdserve
    .venv/bin/python benchmarks/serving.py --rerender      # tables and plot again from the last results
    .venv/bin/python benchmarks/serving.py --sweep         # goodput from a rate sweep (serving_sweep.py)

1. pdserve: `pdserve serve --grpc-port P --port H` (the `pdserve` beside this interpreter; 1 prefill
   + 1 decode worker and every other setting at its default, as `make serve`), until /health is 200.
2. vLLM: `vllm serve HF_DIR --dtype bfloat16 --max-model-len 2048`
   (--vllm-dtype float32 for AVX2 only) with VLLM_CPU_KVCACHE_SPACE=2 and
   VLLM_CPU_OMP_THREADS_BIND=0-1 (both cores), as docs/peers.md says, on the Hugging Face copy of
   the same weights (benchmarks/peers/hf_dir.py, built if missing).
Each is driven at two loads, random prompts of 256 tokens, 64 output tokens, --ignore-eos, seed 0,
after one unmeasured warm-up request (--num-warmups 1):
"rate2" (2 req/s, Poisson arrivals, 32 prompts) and "conc16" (--max-concurrency 16, rate inf, 48
prompts); then stopped (its whole process tree, also on error and Ctrl-C) before the next starts.
--profile records each pdserve worker with py-spy during each load (raw collapsed stacks, and a
summary in the results file), so a missed target comes with where the time goes.

Outputs (--out-dir, default .bench/serving/): serving.json (schema below), serving.md (the tables
BENCHMARKS.md shows), the raw `vllm bench serve` results and logs; the PNG goes to --plot
(default docs/benchmarks/benchmarks_serving.png).

Results file schema, "pdserve-serving-benchmark/1" (times in ms, rates per second):
    schema: str; created: ISO-8601 UTC; git: {commit, dirty}
    machine: {cpus, cpu_model, flags, kernel_path, runnable_paths, shared_note}   (benchmarks/processor.py)
    workload: {dataset: "random", input_len, output_len, ignore_eos: true, seed, load_generator}
    loads: {LOAD: {label, num_prompts, request_rate (null = inf), max_concurrency (null = none)}}
    servers: {SERVER: {command: [str], env: {str: str}, served_model, startup_s, start_attempts}}   SERVER: pdserve | vllm
    results: [{server, load, completed, failed, valid (completed > 0 and failed == 0), duration_s,
               req_s, output_tok_s,
               ttft_ms: {mean, p50, p90, p99}, tpot_ms: {...}, itl_ms: {...}, e2el_ms: {...},
               cpu: {busy_cores, server_cores, window_s, busy_cores_whole_run, server_cores_whole_run,
                     window_s_whole_run, loadavg_1m_before}, raw_result: path}]   paths: relative to the file
    ratios: {LOAD: {ttft_p50, tpot_p50, output_tok_s}}   pdserve / vLLM; null if a side is missing or not valid
    targets: [{target, load, ratio, bound, kind: "max" | "min", value, met: bool | null}]
    profiles: {"pdserve/LOAD/ROLE": {file, samples, waiting_share, self: [[frame, share of busy samples]],
               inclusive: [...]}}                         (serving_report.profile_summary)
cpu.busy_cores is the whole machine's average busy cores over the load's main run (window_s:
vllm bench serve's timed requests, not its start-up or warmup), server_cores the part the
server's own processes used; the rest is the load generator and whatever else runs (the machine
is shared). The *_whole_run figures span the load generator's whole life, as results before
2026-11-25 04:00 UTC did.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import serving_sweep  # noqa: E402
from benchmarks.peers.hf_dir import PEERS  # noqa: E402
from benchmarks.serving_report import compare, markdown, plot, profile_summary, targets  # noqa: E402
from benchmarks.serving_run import (LOADS, check_prerequisites, new_doc, pdserve_server, run_server,  # noqa: E402
                                    vllm_server)


def finish(doc: dict, args) -> None:
    doc["ratios"] = compare(doc["results"], list(doc["loads"]))
    doc["targets"] = targets(doc["ratios"])
    (args.out_dir / "serving.json").write_text(json.dumps(doc, indent=2) + "\n")
    table = markdown(doc)
    (args.out_dir / "serving.md").write_text(table + "\n")
    plot(doc, args.plot)
    print("\n" + table)
    for key, prof in doc["profiles"].items():
        print(f"\npy-spy {key} ({prof['samples']} samples, {100 * (prof['waiting_share'] or 0):.0f}% waiting; "
              f"{prof['file']}), innermost frames of the busy samples:")
        for fn, share in prof["self"][:8]:
            print(f"  {100 * share:5.1f}%  {fn}")
    print(f"\nwrote {args.out_dir / 'serving.json'}, {args.out_dir / 'serving.md'} and {args.plot}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default="pdserve,vllm", help="comma-separated, run in this order")
    ap.add_argument("--loads", default=",".join(l.name for l in LOADS),
                    help=f"comma-separated subset of {', '.join(l.name for l in LOADS)}")
    ap.add_argument("--profile", action="store_true", help="py-spy each pdserve worker during each load")
    ap.add_argument("--profile-router", action="store_true", help="also py-spy pdserve's router")
    ap.add_argument("--pdserve-bin", type=Path, default=Path(sys.executable).parent / "pdserve")
    ap.add_argument("--py-spy", type=Path, default=Path(sys.executable).parent / "py-spy")
    ap.add_argument("--vllm-venv", type=Path, default=Path(os.environ.get("VLLM_PEER_VENV", PEERS / "vllm-venv")))
    ap.add_argument("--hf-dir", type=Path, default=PEERS / "smollm2-hf")
    ap.add_argument("--pdserve-port", type=int, default=8300, help="pdserve's HTTP port")
    ap.add_argument("--pdserve-grpc-port", type=int, default=50351)
    ap.add_argument("--vllm-port", type=int, default=8100)
    ap.add_argument("--vllm-dtype", default=None, choices=("bfloat16", "float32"),
                    help="vLLM's dtype (default bfloat16; with --sweep its best on this processor: float32 on "
                         "AVX2 only, bfloat16 with AVX-512 BF16 or AMX)")
    ap.add_argument("--vllm-threads-bind", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmups", type=int, default=1, help="vllm bench serve --num-warmups, before each load")
    ap.add_argument("--startup-timeout", type=float, default=1800,
                    help="seconds to wait for /health; vLLM compiles at start-up, >10 min on a busy machine")
    ap.add_argument("--start-attempts", type=int, default=3,
                    help="start a server this many times when it exits before it is healthy")
    ap.add_argument("--rerender", action="store_true",
                    help="run nothing: rebuild ratios, targets, profile summaries, table and plot from "
                         "--out-dir's serving.json (and the profiles it names)")
    ap.add_argument("--note", default="", help="what else ran on the machine, stored with the results")
    ap.add_argument("--out-dir", type=Path, default=ROOT / ".bench" / "serving")
    ap.add_argument("--plot", type=Path, default=ROOT / "docs" / "benchmarks" / "benchmarks_serving.png")
    serving_sweep.add_sweep_arguments(ap)
    args = ap.parse_args(argv)
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = set(args.servers) - {"pdserve", "vllm"}
    if unknown:
        ap.error(f"--servers: unknown {sorted(unknown)}; known: pdserve, vllm")
    by_name = {l.name: l for l in LOADS}
    names = [n.strip() for n in args.loads.split(",") if n.strip()]
    if not names or set(names) - set(by_name):
        ap.error(f"--loads: {args.loads!r}; known: {', '.join(by_name)}")
    args.loads = [by_name[n] for n in names]
    return args


def rerender(args) -> None:
    doc = json.loads((args.out_dir / "serving.json").read_text())
    for r in doc["results"]:
        r["valid"] = r["completed"] > 0 and r["failed"] == 0
    for prof in doc["profiles"].values():
        prof.update(profile_summary(args.out_dir / prof["file"]))  # an absolute path stays as it is
    finish(doc, args)


def main() -> None:
    from benchmarks.processor import print_banner

    print_banner()  # the processor and kernel path every figure below ran on
    args = parse_args()
    # Ctrl-C (also when started in the background, where SIGINT comes in ignored) and SIGTERM
    # raise in the main thread, so every `with` and `finally` stops what it started
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.sweep:
        return serving_sweep.main(args)
    args.vllm_dtype = args.vllm_dtype or "bfloat16"
    if args.rerender:
        return rerender(args)
    check_prerequisites(args)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    doc = new_doc(args)
    t0 = time.monotonic()

    def step(msg: str) -> None:
        print(f"\n[serving {time.monotonic() - t0:5.0f} s] {msg}", flush=True)

    makers = {"pdserve": pdserve_server, "vllm": vllm_server}
    print(f"[serving] {', '.join(args.servers)}, one at a time, x {len(LOADS)} loads; output in {args.out_dir}",
          flush=True)
    try:
        for name in args.servers:
            run_server(args, makers[name](args), step, doc)
    except BaseException:
        partial = args.out_dir / "serving.partial.json"
        partial.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"[serving] failed or interrupted; every server is stopped; what was measured: {partial}",
              file=sys.stderr, flush=True)
        raise
    finish(doc, args)


if __name__ == "__main__":
    main()
