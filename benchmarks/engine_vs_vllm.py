"""The engine alone against vLLM-CPU, in one run: batch-1 decode step against the bandwidth
floor, and prefill of one 512-token prompt against vLLM's, in each dtype.

    .venv/bin/python benchmarks/engine_vs_vllm.py                 # float32 and bfloat16, ~15 min
    .venv/bin/python benchmarks/engine_vs_vllm.py --dtypes bfloat16

Runs, one after the other on a machine that should otherwise be quiet:
1. ``benchmarks/peers/vllm_bench.py --dtype D --concurrency 1`` for each dtype: vLLM serving
   the same weights on both cores (its prefill is 512 / TTFT of a fresh 512-token prompt, its
   decode the median time per output token of one stream);
2. ``benchmarks/engine.py --dtypes ... --threads 1 2 --batches 1 --no-baseline``: pdserve's
   engine in-process at one thread (how a cluster worker runs) and two (vLLM's share).

and prints one table of ratios. vLLM's numbers go through its HTTP server (a streamed
request), ours are the engine's step; the difference is at most a few milliseconds per token
and favours pdserve, which the table says. Writes .bench/engine_vs_vllm.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / ".bench"


def run(cmd: list[str]) -> None:
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)


def main() -> None:
    from benchmarks.processor import print_banner

    print_banner()  # the processor and kernel path every figure below ran on
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--vllm-venv", type=Path, default=None, help="vllm_bench.py --venv")
    args = ap.parse_args()
    py = sys.executable
    vllm = {}
    with tqdm(total=len(args.dtypes) + 1, desc="engine vs vLLM") as bar:
        for dtype in args.dtypes:
            out = BENCH / f"vllm_{dtype}_c1.json"
            cmd = [py, "benchmarks/peers/vllm_bench.py", "--dtype", dtype, "--concurrency", "1",
                   "--prefill-len", str(args.prefill_len), "--out", str(out)]
            if args.vllm_venv:
                cmd += ["--venv", str(args.vllm_venv)]
            run(cmd)
            vllm[dtype] = json.loads(out.read_text())
            bar.update(1)
        ours_out = BENCH / "engine_vs_vllm_ours.json"
        run([py, "benchmarks/engine.py", "--dtypes", *args.dtypes, "--threads", "1", "2", "--batches", "1",
             "--no-baseline", "--prefill-len", str(args.prefill_len), "--out", str(ours_out),
             "--plot", str(BENCH / "engine_vs_vllm.png")])
        ours = json.loads(ours_out.read_text())["rows"]
        bar.update(1)
    lines = ["| dtype | pdserve threads | read GB/s | floor ms | pdserve batch-1 step ms | step / floor | "
             "vLLM TPOT ms (1 stream, 2 cores) | vLLM / pdserve | pdserve prefill tok/s | vLLM prefill tok/s "
             "| pdserve / vLLM |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in ours:
        v = vllm[r["dtype"]]
        step = r["decode"]["1"]["ours_ms"]  # JSON keys are strings
        tpot = v["levels"][0]["tpot_ms_p50"]
        lines.append(f"| {r['dtype']} | {r['threads']} | {r['bandwidth_gbs']:.1f} | {r['floor_ms']:.1f} | {step:.1f} | "
                     f"{step / r['floor_ms']:.2f}x | {tpot:.1f} | {tpot / step:.2f}x | {r['prefill']['ours_tps']:.0f} | "
                     f"{v['prefill']['tok_s']:.0f} | {r['prefill']['ours_tps'] / v['prefill']['tok_s']:.2f}x |")
    table = "\n".join(lines)
    print(table)
    (BENCH / "engine_vs_vllm.json").write_text(json.dumps({"vllm": vllm, "pdserve": ours, "table": table}, indent=2))


if __name__ == "__main__":
    main()
