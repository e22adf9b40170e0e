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
import shlex
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import processor  # noqa: E402
from benchmarks.peers.hf_dir import PEERS, build as build_hf_dir  # noqa: E402
from benchmarks.serving_procs import (Profiler, ServerError, ServerExited, ServerProcess,  # noqa: E402
                                      busy_seconds, classify_worker, cpu_seconds, cpu_shares, run_teed,
                                      server_actor_pids, server_tree)
from benchmarks.serving_report import (compare, markdown, plot, profile_summary, record,  # noqa: E402
                                       targets)

HOST = "127.0.0.1"
SCHEMA = "pdserve-serving-benchmark/1"


@dataclass(frozen=True)
class Load:
    name: str
    label: str
    num_prompts: int
    request_rate: float | None  # None: inf, all at once up to max_concurrency
    max_concurrency: int | None
    seed: int | None = None  # None: --seed (the sweep gives each rate prompts of its own)
    warmups: int | None = None  # None: --warmups


LOADS = (Load("rate2", "2 req/s, 32 prompts", 32, 2.0, None),
         Load("conc16", "concurrency 16, 48 prompts", 48, None, 16))


def pdserve_server(args) -> ServerProcess:
    cmd = [str(args.pdserve_bin), "serve", "--grpc-port", str(args.pdserve_grpc_port),
           "--port", str(args.pdserve_port), *shlex.split(getattr(args, "pdserve_flags", ""))]
    # PYTHONPATH: this checkout's code, also in the Ray workers, when run from a worktree
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return ServerProcess("pdserve", cmd, env, HOST, [args.pdserve_port, args.pdserve_grpc_port],
                         args.out_dir / "pdserve_server.log")


def vllm_server(args) -> ServerProcess:
    cmd = [str(args.vllm_venv / "bin" / "vllm"), "serve", str(args.hf_dir), "--served-model-name", "smollm2",
           "--host", HOST, "--port", str(args.vllm_port), "--dtype", args.vllm_dtype, "--max-model-len", "2048"]
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="2",
               VLLM_CPU_OMP_THREADS_BIND=args.vllm_threads_bind, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    env.pop("PYTHONPATH", None)  # vLLM's venv must not import this project's packages
    return ServerProcess("vllm", cmd, env, HOST, [args.vllm_port], args.out_dir / "vllm_server.log")


def bench_cmd(args, port: int, model: str, load: Load, result: Path) -> list[str]:
    cmd = [str(args.vllm_venv / "bin" / "vllm"), "bench", "serve", "--backend", "openai",
           "--base-url", f"http://{HOST}:{port}", "--endpoint", "/v1/completions", "--model", model,
           "--tokenizer", str(args.hf_dir), "--dataset-name", "random",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--random-range-ratio", "0", "--num-prompts", str(load.num_prompts),
           "--request-rate", "inf" if load.request_rate is None else f"{load.request_rate:g}",
           "--seed", str(args.seed if load.seed is None else load.seed),
           "--num-warmups", str(args.warmups if load.warmups is None else load.warmups),
           "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "50,90,99", "--save-result", "--result-dir", str(result.parent),
           "--result-filename", result.name, "--save-detailed"]
    if load.max_concurrency is not None:
        cmd += ["--max-concurrency", str(load.max_concurrency)]
    if getattr(args, "sweep", False):  # vLLM's own goodput beside the sweep's attainment
        cmd += ["--goodput", f"ttft:{args.slo_ttft_ms:g}", f"tpot:{args.slo_tpot_ms:g}"]
    return cmd


def bench_env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    env.pop("PYTHONPATH", None)
    return env


# vllm bench serve's lines around its main run (after the warmup requests)
MAIN_RUN_START = b"Starting main benchmark run"
MAIN_RUN_END = b"Serving Benchmark Result"


def start_profiles(args, server: ServerProcess, load: Load, profiler: Profiler) -> dict[str, Path]:
    files = {}
    for pid in server_actor_pids(server):
        role = classify_worker(args.py_spy, pid) or "unknown"
        if role == "router" and not args.profile_router:
            continue
        if role in files:  # never two recorders on one file
            role = f"{role}-pid{pid}"
        out = args.out_dir / "profiles" / f"pdserve-{load.name}-{role}.txt"
        profiler.start(pid, out)
        files[role] = out
    return files


def run_server(args, server: ServerProcess, step, doc: dict) -> None:
    """Start one server, run every load against it, stop it (also on error)."""
    name = server.name
    with ExitStack() as stack:
        stack.enter_context(server)  # stopped on the way out, whatever happens
        startup, attempt = start(args, server, step)
        model = server.served_model()
        doc["servers"][name] = {"command": server.cmd, "served_model": model, "startup_s": round(startup, 1),
                                "start_attempts": attempt,
                                "env": {k: server.env[k] for k in sorted(server.env)
                                        if k.startswith(("VLLM_", "PDSERVE_"))}}
        step(f"{name}: healthy after {startup:.0f} s, serving '{model}'")
        for load in args.loads:
            result = args.out_dir / f"{name}-{load.name}.json"
            result.unlink(missing_ok=True)
            profiler, files = Profiler(args.py_spy), {}
            if args.profile and name == "pdserve":
                files = start_profiles(args, server, load, profiler)
            step(f"{name}: {load.label}" + (f" (py-spy on {', '.join(files)})" if files else ""))
            tree, loadavg = server_tree(server), os.getloadavg()[0]
            # CPU over the main run only: from vllm bench's "Starting main benchmark run" to
            # its result banner (not its start-up, tokenizer load, prompt sampling or warmup,
            # which ran the load generator alone and made every server look idler).
            marks: dict[str, tuple[float, float, float]] = {}

            def mark(label: str, tree=tree) -> None:
                marks[label] = (time.monotonic(), busy_seconds(), cpu_seconds(tree))

            mark("launch")
            try:
                rc = run_teed(bench_cmd(args, server.port, model, load, result), bench_env(),
                              args.out_dir / f"{name}-{load.name}.log",
                              marks={MAIN_RUN_START: lambda: mark("start"), MAIN_RUN_END: lambda: mark("end")})
            finally:
                written = profiler.stop()
            mark("exit")
            if not {"start", "end"} <= marks.keys():  # another vllm's wording: the whole run, said so
                step(f"{name}: vllm bench printed no main-run marks; busy cores span its whole run")
            cpu = cpu_shares(marks.get("start", marks["launch"]), marks.get("end", marks["exit"]))
            cpu.update({f"{k}_whole_run": v for k, v in cpu_shares(marks["launch"], marks["exit"]).items()},
                       loadavg_1m_before=loadavg)
            if rc != 0 or not result.exists():
                raise ServerError(f"vllm bench serve against {name} ({load.name}) exited with {rc}; "
                                  f"log: {args.out_dir / f'{name}-{load.name}.log'}")
            row = record(name, load.name, json.loads(result.read_text()))
            doc["results"].append({**row, "cpu": cpu, "raw_result": str(result.relative_to(args.out_dir))})
            for role, f in files.items():
                if f in written:
                    doc["profiles"][f"{name}/{load.name}/{role}"] = {"file": str(f.relative_to(args.out_dir)),
                                                                    **profile_summary(f)}
        step(f"{name}: stopping")


def start(args, server: ServerProcess, step) -> tuple[float, int]:
    """Wait until the (entered) server is healthy, restarting it when it exits first, up to
    --start-attempts times; returns (seconds to healthy, attempt)."""
    attempt = 1
    while True:
        step(f"{server.name}: starting, attempt {attempt} ({' '.join(server.cmd)})")
        try:
            with tqdm(total=int(args.startup_timeout), desc=f"{server.name} start-up (model load, warm-up)",
                      unit="s", leave=False) as bar:
                return server.wait_healthy(args.startup_timeout, lambda t: bar.update(int(t) - bar.n)), attempt
        except ServerExited as exc:
            if attempt >= args.start_attempts:
                raise
            print(f"[serving] {exc}\n[serving] trying again", file=sys.stderr, flush=True)
            server.stop()
            server.__enter__()
            attempt += 1


def git_state() -> dict:
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def new_doc(args) -> dict:
    return {
        "schema": SCHEMA, "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "git": git_state(),
        "machine": {**processor.describe(), "shared_note": args.note},
        "workload": {"dataset": "random", "input_len": args.input_len, "output_len": args.output_len,
                     "ignore_eos": True, "seed": args.seed, "load_generator": "vllm bench serve (vllm-cpu 0.32.0)"},
        "loads": {l.name: {"label": l.label, "num_prompts": l.num_prompts, "request_rate": l.request_rate,
                           "max_concurrency": l.max_concurrency} for l in getattr(args, "loads", LOADS)},
        "servers": {}, "results": [], "ratios": {}, "targets": [], "profiles": {},
    }


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
    from benchmarks.serving_sweep import add_sweep_arguments

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
    add_sweep_arguments(ap)
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


def check_prerequisites(args) -> None:
    missing = [p for p in (args.vllm_venv / "bin" / "vllm",) if not p.exists()]
    if "pdserve" in args.servers and not args.pdserve_bin.exists():
        missing.append(args.pdserve_bin)
    if args.profile and not args.py_spy.exists():
        missing.append(args.py_spy)
    if missing:
        sys.exit(f"missing {', '.join(map(str, missing))}: run bash benchmarks/peers/setup_vllm.sh "
                 "(VLLM_PEER_VENV=... or --vllm-venv for another venv) and use the project's .venv")
    if not (args.hf_dir / "config.json").exists():
        print(f"[serving] building the HF directory {args.hf_dir} (benchmarks/peers/hf_dir.py)", flush=True)
        build_hf_dir(args.hf_dir)


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
        from benchmarks.serving_sweep import main as sweep

        return sweep(args)
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
