"""How the serving benchmark runs a server (benchmarks/serving.py, and its --sweep,
benchmarks/serving_sweep.py, which both import this; benchmarks/conversations.py starts its servers
the same way): pdserve or vLLM started and waited for, each load driven by `vllm bench serve`, its
CPU use and profiles recorded, the server stopped; and the results document they fill in."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from tqdm import tqdm

from benchmarks import processor
from benchmarks.peers.hf_dir import build as build_hf_dir
from benchmarks.serving_procs import (Profiler, ServerError, ServerExited, ServerProcess, busy_seconds,
                                      classify_worker, cpu_seconds, cpu_shares, run_teed, server_actor_pids,
                                      server_tree)
from benchmarks.serving_report import profile_summary, record

ROOT = Path(__file__).resolve().parent.parent
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
