"""Engine benchmark: decode step time and prefill throughput against transformers, and the
memory-bandwidth floor of a batch-1 decode step, all measured in one run on this machine.

    .venv/bin/python benchmarks/engine.py                      # both dtypes, batches 1 8 16 32
    .venv/bin/python benchmarks/engine.py --dtypes float32 --batches 1 8
    .venv/bin/python benchmarks/engine.py --dtypes bfloat16 --threads 1 2 --no-baseline
    .venv/bin/python benchmarks/engine.py --tp 1 2 --threads 2 --model tp-shaped --no-baseline

Both dtypes run pdserve's batch-invariant kernels on CPU (pdserve/engine/kernels/csrc/linear.cpp; float32
keeps torch's RMSNorm and SiLU). ``--threads`` repeats everything at each torch thread count (a cluster worker
runs one), with the bandwidth, and so the floor, measured at that count.

Decode: B requests with random 256-token prompts are prefilled, then ``--steps`` decode
steps are timed (ms per step; tokens/s = B / step time). The baseline is
``transformers`` ``generate`` on the same weights and dtype: (time to generate 1 + steps
tokens - time to generate 1 token) / steps. Prefill: one 512-token prompt, best of 3.
The floor is the bytes of weights a decode step must read (every linear and the LM head,
as stored: packed bfloat16 or float32, or torch's) divided by a measured memory read bandwidth (a
large tensor sum). Writes JSON to .bench/engine.json and a plot beside
BENCHMARKS.md.

``--tp`` repeats everything at each tensor-parallel size: the engine runs on that many ranks
(processes), which share ``--threads`` (each runs threads / tp of them), so TP 1 and TP 2 at
the same ``--threads`` use the same cores. The default model's 9 heads and 3 KV heads split
only over 3 ranks: ``--model tp-shaped`` is a random-weight Llama of SmolLM2-135M's sizes but
8 heads and 2 KV heads (built once under .bench/), which 1, 2 and 4 ranks split. The weights
and floor columns are rank 0's share (and the LM head, which rank 0 alone holds).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pdserve.engine.config import MIXED, CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from pdserve.engine.linear import PackedLinear  # noqa: E402
from pdserve.engine.llm_engine import LLMEngine  # noqa: E402
from pdserve.engine.loader import materialize  # noqa: E402
from pdserve.engine.models.decoder import CausalLM  # noqa: E402
from pdserve.engine.sampling.params import SamplingParams  # noqa: E402


def read_bandwidth_gbs(gib: float = 0.5, repeats: int = 5) -> float:
    """Best-of-N read bandwidth of a tensor much larger than any cache, at torch's thread count."""
    x = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def step_weight_bytes(model: CausalLM) -> int:
    """Bytes of weights one decode step streams: every linear, and the LM head."""
    total = 0
    for m in model.modules():
        if isinstance(m, PackedLinear):
            total += m.packed.numel() * m.packed.element_size()
        elif isinstance(m, torch.nn.Linear):
            total += m.weight.numel() * m.weight.element_size()
    if model.lm_head.kernel is None:  # unpacked: the head's rows (the embedding's, when tied)
        head = model.lm_head.matrix()
        total += head.numel() * head.element_size()
    return total


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab - 100, (length,), generator=g).tolist() for _ in range(n)]


def ours_decode_ms(engine: LLMEngine, batch: int, prompt_len: int, steps: int) -> float:
    vocab = engine.model_cfg.vocab_size
    params = SamplingParams(max_tokens=steps + 8, ignore_eos=True)
    for i, p in enumerate(random_prompts(batch, prompt_len, vocab, seed=batch)):
        engine.add_request(f"d{batch}-{i}", p, params)
    while engine.scheduler.waiting:
        engine.step()
    for _ in range(2):
        engine.step()
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - t
    while engine.has_unfinished():
        engine.step()
    return elapsed / steps * 1e3


def ours_prefill_tps(engine: LLMEngine, length: int, repeats: int = 3) -> float:
    best = float("inf")
    for r in range(repeats):
        prompt = random_prompts(1, length, engine.model_cfg.vocab_size, seed=1000 + r)[0]
        engine.add_request(f"p{length}-{r}", prompt, SamplingParams(max_tokens=1))
        t = time.perf_counter()
        engine.step()
        best = min(best, time.perf_counter() - t)
    return length / best


def hf_generate_s(model, prompts: list[list[int]], new_tokens: int) -> float:
    ids = torch.tensor(prompts)
    t = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return time.perf_counter() - t


def hf_decode_ms(model, batch: int, prompt_len: int, steps: int, vocab: int) -> float:
    prompts = random_prompts(batch, prompt_len, vocab, seed=batch)
    hf_generate_s(model, prompts, 2)  # warm-up
    one = min(hf_generate_s(model, prompts, 1) for _ in range(2))
    many = hf_generate_s(model, prompts, 1 + steps)
    return (many - one) / steps * 1e3


def hf_prefill_tps(model, length: int, vocab: int, repeats: int = 3) -> float:
    best = min(hf_generate_s(model, random_prompts(1, length, vocab, seed=1000 + r), 1) for r in range(repeats))
    return length / best


TP_SHAPED = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                 num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192, rms_norm_eps=1e-5,
                 rope_theta=100000.0, tie_word_embeddings=True)


def model_path(name: str) -> str:
    """``tp-shaped``: SmolLM2-135M's sizes with heads 2 and 4 ranks split, random weights, built
    once under .bench/; anything else as the engine takes it."""
    if name != "tp-shaped":
        return name
    directory = ROOT / ".bench" / "tp-shaped-llama"
    if not (directory / "config.json").exists():
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TP_SHAPED), dtype=torch.float32)
        model.save_pretrained(str(directory), safe_serialization=True)
    return str(directory)


def bench_dtype(dtype: str, threads: int, tp: int, batches: list[int], bandwidth: float, bar: tqdm, args) -> dict:
    from transformers import AutoModelForCausalLM

    engine = LLMEngine.from_config(EngineConfig(
        model=model_path(args.model), dtype=dtype, tensor_parallel_size=tp,
        cache=CacheConfig(memory_budget_bytes=4 << 30, enable_prefix_cache=False),
        # As a decode worker runs it: mixed steps, and so its weights on huge pages (engine.huge_pages).
        scheduler=SchedulerConfig(max_num_seqs=max(batches), max_num_batched_tokens=8192, policy=MIXED)), progress=False,
        detokenize=False)
    try:
        return bench_engine(engine, dtype, threads, tp, batches, bandwidth, bar, args, AutoModelForCausalLM)
    finally:
        engine.close()


def bench_engine(engine: LLMEngine, dtype: str, threads: int, tp: int, batches: list[int], bandwidth: float,
                 bar: tqdm, args, auto_model) -> dict:
    hf = (auto_model.from_pretrained(str(materialize(model_path(args.model))), dtype=getattr(torch, dtype)).eval()
          if args.baseline else None)
    vocab = engine.model_cfg.vocab_size
    wbytes = step_weight_bytes(engine.runner.model)
    row = {"dtype": dtype, "threads": threads, "tp": tp, "kernels": engine.runner.model.linear_backend,
           "bandwidth_gbs": bandwidth, "weight_bytes": wbytes, "floor_ms": wbytes / (bandwidth * 1e9) * 1e3,
           "decode": {}}
    nan = float("nan")
    for b in batches:
        bar.set_postfix_str(f"{dtype} x{threads} tp {tp} decode b={b}")
        ours = ours_decode_ms(engine, b, args.prompt_len, args.steps)
        base = hf_decode_ms(hf, b, args.prompt_len, args.steps, vocab) if hf else nan
        row["decode"][b] = {"ours_ms": ours, "hf_ms": base, "ours_tps": b / ours * 1e3, "hf_tps": b / base * 1e3}
        bar.update(1)
    bar.set_postfix_str(f"{dtype} x{threads} tp {tp} prefill")
    row["prefill"] = {"ours_tps": ours_prefill_tps(engine, args.prefill_len),
                      "hf_tps": hf_prefill_tps(hf, args.prefill_len, vocab) if hf else nan}
    bar.update(1)
    return row


def report(rows: list[dict], args) -> str:
    lines = [f"model {args.model}; prompts {args.prompt_len} tokens; {args.steps} timed steps", "",
             "| dtype | threads | tp | batch | ours ms/step | transformers ms/step | ours tok/s | transformers tok/s "
             "| speed-up |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for b, d in r["decode"].items():
            lines.append(f"| {r['dtype']} | {r['threads']} | {r['tp']} | {b} | {d['ours_ms']:.1f} | {d['hf_ms']:.1f} | "
                         f"{d['ours_tps']:.0f} | {d['hf_tps']:.0f} | {d['hf_ms'] / d['ours_ms']:.2f}x |")
    lines += ["", "| dtype (kernels) | threads | tp | read GB/s | weights MB | floor ms (batch 1) | ours batch-1 ms | "
              f"ours / floor | prefill {args.prefill_len} tok/s ours | transformers | ratio |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b1 = r["decode"].get(1, {}).get("ours_ms", float("nan"))
        p = r["prefill"]
        lines.append(f"| {r['dtype']} ({r['kernels']}) | {r['threads']} | {r['tp']} | {r['bandwidth_gbs']:.1f} | "
                     f"{r['weight_bytes'] / 1e6:.0f} | {r['floor_ms']:.1f} | {b1:.1f} | {b1 / r['floor_ms']:.2f}x | "
                     f"{p['ours_tps']:.0f} | {p['hf_tps']:.0f} | {p['ours_tps'] / p['hf_tps']:.2f}x |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        bs = list(r["decode"])
        tag = f"{r['dtype']}, {r['threads']} thread(s)" + (f", TP {r['tp']}" if r["tp"] > 1 else "")
        ax.plot(bs, [r["decode"][b]["ours_tps"] for b in bs], "o-", label=f"pdserve {tag}")
        ax.plot(bs, [r["decode"][b]["hf_tps"] for b in bs], "s--", label=f"transformers {tag}")
    ax.set_xlabel("decode batch size")
    ax.set_ylabel("output tokens / s")
    ax.set_title("Decode throughput, SmolLM2-135M, 2 CPU cores")
    ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    from benchmarks.processor import print_banner

    print_banner()  # the processor and kernel path every figure below ran on
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--threads", nargs="+", type=int, default=[torch.get_num_threads()])
    ap.add_argument("--tp", nargs="+", type=int, default=[1], help="tensor-parallel sizes (ranks share --threads)")
    ap.add_argument("--model", default="default", help="'default', a HF directory, or tp-shaped (see above)")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 16, 32])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--no-baseline", dest="baseline", action="store_false", help="skip transformers")
    ap.add_argument("--out", type=Path, default=ROOT / ".bench" / "engine.json")
    ap.add_argument("--plot", type=Path, default=ROOT / "docs" / "benchmarks" / "benchmarks_engine.png")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    total = len(args.threads) * len(args.tp) * len(args.dtypes) * (len(args.batches) + 1)
    with tqdm(total=total, desc="engine benchmark") as bar:
        for threads in args.threads:
            torch.set_num_threads(threads)
            bandwidth = read_bandwidth_gbs()
            for tp in args.tp:
                for d in args.dtypes:
                    torch.set_num_threads(threads)  # a TP engine's rank 0 takes its share of them
                    rows.append(bench_dtype(d, threads, tp, args.batches, bandwidth, bar, args))
    text = report(rows, args)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows}, indent=2))
    plot(rows, args.plot)
    print(f"\nwrote {args.out} and {args.plot}")


if __name__ == "__main__":
    main()
