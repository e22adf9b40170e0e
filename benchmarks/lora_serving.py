"""Multi-LoRA serving throughput against the base model, in one run (issue 57's must-show: four
adapters mixed at most 15% below the base model at concurrency 16, served).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/lora_serving.py [--requests 48] [--concurrency 16]

Serves the default model (SmolLM2-135M-Instruct, bfloat16 unless --dtype) disaggregated as it
is deployed: the router, one prefill and one decode worker, each a `pdserve worker` process with
one torch thread, NIXL between the workers (benchmarks/lora_serving_procs.py); with --threads,
the same three as threads of this process (tests/helpers/lora_serving.py). Every worker with
--enable-lora and four random adapters of rank --rank on every projection (PEFT's format,
tests/helpers/lora.py), --max-loras 4. The same
cluster then runs --rounds rounds of two phases, each of --requests requests by --concurrency
closed-loop gRPC clients, each prompt --prompt-tokens random token ids and --output-tokens
generated (ignore_eos): the base model alone, then the four adapters round robin. Each phase has
prompts of its own (no prefix hit helps either); a warm-up request per model comes first. The
rounds alternate the two so that a box whose load drifts (other work on it) does not favour
one (served as deployed, one round runs first, unmeasured: the first phase after start ran
slow). Prints each phase's output tokens per second, each round's ratio mixed / base and their
median (the target: at least 0.85). With --step-trace-dir, each worker writes its engine steps
there and a table of each phase's steps per worker follows (benchmarks/lora_steps.py).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import processor  # noqa: E402
from benchmarks.lora_serving_procs import SERVED_NAME, ProcessCluster  # noqa: E402
from benchmarks.lora_steps import Window, report  # noqa: E402
from pdserve.engine.loader import materialize  # noqa: E402
from pdserve.protos import pdserve_pb2, pdserve_pb2_grpc  # noqa: E402
from tests.helpers.lora import make_adapter  # noqa: E402
from tests.helpers.lora_serving import LoRACluster  # noqa: E402

ADAPTERS = ("a0", "a1", "a2", "a3")
TARGET = 0.85  # mixed throughput at least this share of the base model's


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=48, help="requests per phase")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16, help="each adapter's rank")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--num-blocks", type=int, default=1024, help="KV blocks per worker (16 tokens each)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=2, help="base then mixed, this many times")
    ap.add_argument("--step-trace-dir", default=None, help="each worker's engine steps go here, summed per phase after")
    ap.add_argument("--threads", dest="processes", action="store_false",
                    help="serve from threads of this process (tests/helpers/lora_serving.py), as the runs before "
                         "2026-11-30 did, not as deployed (the default: router, prefill and decode worker each a "
                         "`pdserve worker` process with one torch thread, benchmarks/lora_serving_procs.py)")
    return ap.parse_args(argv)


def write_adapters(directory: Path, rank: int) -> tuple[tuple[str, str], ...]:
    """Four random adapters of the default model, on every attention and MLP projection."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(materialize("default", progress=False)), dtype=torch.float32)
    out = []
    for i, name in enumerate(ADAPTERS):
        make_adapter(hf, directory / name, rank=rank, alpha=2 * rank, seed=100 + i, std=0.02)
        out.append((name, str(directory / name)))
    return tuple(out)


def start_cluster(args, modules: tuple[tuple[str, str], ...], logs: Path):
    """The served cluster, in this process (threads) or as deployed (``--processes``)."""
    model_dir, rank, seqs = materialize("default", progress=False), max(args.rank, 16), max(args.concurrency, 16)
    if args.processes:
        return ProcessCluster(model_dir, modules, logs, dtype=args.dtype, max_lora_rank=rank, max_num_seqs=seqs,
                              step_trace_dir=args.step_trace_dir)
    return LoRACluster(model_dir, modules, served_name=SERVED_NAME, num_blocks=args.num_blocks, max_lora_rank=rank,
                       dtype=args.dtype, max_num_seqs=seqs, step_trace_dir=args.step_trace_dir)


def one(address: str, model: str, prompt: list[int], output_tokens: int) -> int:
    with grpc.insecure_channel(address) as channel:
        req = pdserve_pb2.GenerateRequest(model=model, token_ids=pdserve_pb2.TokenIds(ids=prompt),
                                          sampling=pdserve_pb2.SamplingParams(max_tokens=output_tokens,
                                                                              ignore_eos=True))
        return sum(len(r.token_ids) for r in pdserve_pb2_grpc.GenerationStub(channel).Generate(req, timeout=600))


def phase(address: str, models: list[str], args, rng: random.Random) -> dict:
    """Every request of one phase by ``args.concurrency`` clients; output tokens per second."""
    prompts = [[rng.randrange(1000, 40000) for _ in range(args.prompt_tokens)] for _ in models]
    for model in sorted(set(models)):  # warm-up: one short request per model
        one(address, model, prompts[0][:16], 2)
    start, wall = time.perf_counter(), time.time()
    with ThreadPoolExecutor(args.concurrency) as pool:
        tokens = sum(pool.map(lambda i: one(address, models[i], prompts[i], args.output_tokens), range(len(models))))
    seconds = time.perf_counter() - start
    return {"requests": len(models), "output_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "start": wall, "end": time.time()}


def main(argv=None) -> int:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    processor.print_banner()
    with tempfile.TemporaryDirectory() as tmp:
        modules = write_adapters(Path(tmp), args.rank)
        cluster = start_cluster(args, modules, ROOT / ".bench" / "lora_serving")
        ratios, windows = [], []
        try:
            if args.processes:  # the first phase after start ran ~10% slow in three runs (base 212-223 tok/s
                # against 234-260 after), flattering round 1's ratio (0.98-1.03): one round unmeasured (a slow
                # first base phase still came in two runs of four since: not the start alone, BENCHMARKS.md)
                for models in ([SERVED_NAME] * args.requests, [ADAPTERS[i % 4] for i in range(args.requests)]):
                    phase(cluster.grpc_address, models, args, rng)
            for r in range(args.rounds):
                base = phase(cluster.grpc_address, [SERVED_NAME] * args.requests, args, rng)
                mixed = phase(cluster.grpc_address, [ADAPTERS[i % 4] for i in range(args.requests)], args, rng)
                ratios.append(mixed["tokens_per_s"] / base["tokens_per_s"])
                windows += [Window(f"base {r + 1}", base["start"], base["end"]),
                            Window(f"mixed {r + 1}", mixed["start"], mixed["end"])]
                print(f"round {r + 1}: base {base['tokens_per_s']:.1f} output tokens/s ({base['seconds']:.1f} s), "
                      f"4 adapters {mixed['tokens_per_s']:.1f} ({mixed['seconds']:.1f} s), ratio {ratios[-1]:.3f}",
                      flush=True)
        finally:
            cluster.stop()
    if args.step_trace_dir:
        report(args.step_trace_dir, windows)
    ratio = statistics.median(ratios)
    verdict = "meets" if ratio >= TARGET else "MISSES"
    print(f"median ratio mixed/base: {ratio:.3f} ({verdict} the target {TARGET}); {datetime.now(timezone.utc):%Y-%m-%d %H:%M} "
          f"UTC; concurrency {args.concurrency}, {args.requests} requests/phase, {args.prompt_tokens}+"
          f"{args.output_tokens} tokens, rank {args.rank}, {args.dtype}, "
          f"{'processes, 1 torch thread each' if args.processes else 'threads of one process'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
