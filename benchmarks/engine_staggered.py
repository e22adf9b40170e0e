"""Engine alone at staggered context lengths, at one torch thread, the way a pdserve worker runs
it (issue 9); against `transformers` on the same weights, in the same run.

    .venv/bin/python benchmarks/engine_staggered.py                     # float32 and bfloat16, ~3 min
    .venv/bin/python benchmarks/engine_staggered.py --dtypes bfloat16 --batch 16 --min-len 64 --max-len 1024

Under real traffic every sequence in a decode batch has its own context length; benchmarks/engine.py
prefills every sequence to the same length and never times that. Here a batch of --batch sequences
has prompts spread evenly over --min-len..--max-len tokens (random token ids). Each is prefilled
(at all cores: set-up, not measured), then --steps decode steps are timed one by one at --threads
torch threads (default 1: `pdserve serve` gives each of its 2 workers cores / workers threads).
Reported: the median step (ms) and tokens/s = batch / step.

Rows per dtype:
- pdserve, staggered: the engine (LLMEngine, public API only) on the staggered batch;
- pdserve, uniform: the same engine, every sequence at the mean of the staggered lengths (the same
  number of context tokens), so the difference is what staggering alone costs;
- transformers, staggered: the same sequences, each prefilled alone, its KV cache left-padded into
  one batch (attention mask zero on the pads, position ids each sequence's own), then greedy steps of
  `model(...)` with that cache: what `generate` does for a left-padded batch, without re-prefilling.
Writes JSON to --out (default .bench/engine_staggered.json) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from pdserve.engine.llm_engine import LLMEngine  # noqa: E402
from pdserve.engine.loader import materialize  # noqa: E402
from pdserve.engine.sampling.params import SamplingParams  # noqa: E402

FIRST_REGULAR_ID = 100  # skip SmolLM2's special tokens


def spread(batch: int, lo: int, hi: int) -> list[int]:
    """batch lengths evenly spaced over lo..hi, both ends included."""
    return [lo] * batch if batch == 1 else [round(lo + (hi - lo) * i / (batch - 1)) for i in range(batch)]


def prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(FIRST_REGULAR_ID, vocab - FIRST_REGULAR_ID, (n,), generator=g).tolist() for n in lengths]


class torch_threads:
    """torch's intra-op thread count inside the block, restored after it."""

    def __init__(self, n: int):
        self.n, self.before = n, torch.get_num_threads()

    def __enter__(self) -> None:
        torch.set_num_threads(self.n)

    def __exit__(self, *exc) -> None:
        torch.set_num_threads(self.before)


def engine_steps(engine: LLMEngine, batch: list[list[int]], steps: int, n_threads: int,
                 tag: str) -> tuple[list[float], list[list[int]]]:
    """Prefill every prompt (all cores), then time `steps` pure decode steps at n_threads.
    Returns the step times (ms) and each sequence's greedy tokens (first token included)."""
    params = SamplingParams(max_tokens=steps + 8, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(batch))]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    for rid, p in zip(ids, batch):
        engine.add_request(rid, p, params)

    def step() -> None:
        for o in engine.step():
            tokens[o.request_id].extend(o.new_token_ids)

    with torch_threads(os.cpu_count()):
        while not all(tokens.values()):  # until every sequence has its first token: all are decoding
            step()
    times = []
    with torch_threads(n_threads):
        for i in range(steps + 2):  # the first two are warm-up: allocator, first-call paths
            t = time.perf_counter()
            step()
            if i >= 2:
                times.append((time.perf_counter() - t) * 1e3)
    for rid in ids:
        engine.abort(rid)
    return times, [tokens[rid] for rid in ids]


def hf_steps(model, batch: list[list[int]], steps: int, n_threads: int) -> tuple[list[float], list[list[int]]]:
    """transformers: each prompt prefilled alone, caches left-padded into one batch, then timed
    greedy steps. Returns the step times (ms) and each sequence's tokens, as engine_steps."""
    from transformers import DynamicCache

    longest = max(len(p) for p in batch)
    per_layer: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    first = []
    with torch.no_grad(), torch_threads(os.cpu_count()):
        for p in batch:
            out = model(torch.tensor([p]), use_cache=True)
            first.append(int(out.logits[0, -1].argmax()))
            pad = longest - len(p)
            layers = [(torch.nn.functional.pad(k, (0, 0, pad, 0)), torch.nn.functional.pad(v, (0, 0, pad, 0)))
                      for k, v in _layers(out.past_key_values)]  # each (1, kv_heads, longest, head_dim)
            per_layer.append(layers)
    cache = DynamicCache()
    for i in range(len(per_layer[0])):
        cache.update(torch.cat([s[i][0] for s in per_layer]), torch.cat([s[i][1] for s in per_layer]), i)
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in batch])  # (B, longest)
    pos = torch.tensor([[len(p)] for p in batch])  # (B, 1): each sequence's next position
    tokens = torch.tensor([[t] for t in first])  # (B, 1)
    generated = [[t] for t in first]
    times = []
    with torch.no_grad(), torch_threads(n_threads):
        for step in range(steps + 2):
            mask = torch.cat([mask, torch.ones(len(batch), 1, dtype=mask.dtype)], dim=1)
            t = time.perf_counter()
            out = model(input_ids=tokens, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
            tokens = out.logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
            elapsed = (time.perf_counter() - t) * 1e3
            for seq, tok in zip(generated, tokens[:, 0].tolist()):
                seq.append(tok)
            if step >= 2:  # the first two are warm-up, as for the engine
                times.append(elapsed)
            pos = pos + 1
    return times, generated


def _layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(key, value) per layer from a transformers cache, across the 4.x and 5.x layouts."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


def summary(times: list[float], batch: int) -> dict:
    med = statistics.median(times)
    return {"step_ms_p50": round(med, 2), "step_ms_min": round(min(times), 2), "step_ms_max": round(max(times), 2),
            "tok_s": round(batch / med * 1e3, 1), "steps": len(times)}


def bench_dtype(dtype: str, args, bar: tqdm) -> dict:
    from transformers import AutoModelForCausalLM

    engine = LLMEngine.from_config(EngineConfig(
        dtype=dtype, cache=CacheConfig(memory_budget_bytes=2 << 30, enable_prefix_cache=False),
        scheduler=SchedulerConfig(max_num_seqs=max(64, args.batch))), progress=False)
    vocab = engine.model_cfg.vocab_size
    lengths = spread(args.batch, args.min_len, args.max_len)
    staggered = prompts(lengths, vocab, args.seed)
    uniform = prompts([round(sum(lengths) / len(lengths))] * args.batch, vocab, args.seed + 1)
    row = {"dtype": dtype, "lengths": lengths}
    bar.set_postfix_str(f"{dtype}: pdserve staggered")
    row["pdserve_staggered"] = summary(engine_steps(engine, staggered, args.steps, args.threads, "s")[0], args.batch)
    bar.update(1)
    bar.set_postfix_str(f"{dtype}: pdserve uniform")
    row["pdserve_uniform"] = summary(engine_steps(engine, uniform, args.steps, args.threads, "u")[0], args.batch)
    bar.update(1)
    del engine
    bar.set_postfix_str(f"{dtype}: transformers staggered")
    hf = AutoModelForCausalLM.from_pretrained(str(materialize("default")), dtype=getattr(torch, dtype)).eval()
    row["transformers_staggered"] = summary(hf_steps(hf, staggered, args.steps, args.threads)[0], args.batch)
    bar.update(1)
    return row


def report(rows: list[dict], args) -> str:
    lines = [f"batch {args.batch}, contexts {args.min_len}..{args.max_len} tokens, {args.threads} torch thread(s), "
             f"median of {args.steps} steps",
             "", "| dtype | pdserve staggered ms/step | pdserve uniform ms/step | transformers staggered ms/step | "
             "pdserve tok/s | transformers tok/s | pdserve speed-up | staggered / uniform |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s, u, h = r["pdserve_staggered"], r["pdserve_uniform"], r["transformers_staggered"]
        lines.append(f"| {r['dtype']} | {s['step_ms_p50']:.1f} | {u['step_ms_p50']:.1f} | {h['step_ms_p50']:.1f} | "
                     f"{s['tok_s']:.0f} | {h['tok_s']:.0f} | {h['step_ms_p50'] / s['step_ms_p50']:.2f}x | "
                     f"{s['step_ms_p50'] / u['step_ms_p50']:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    from benchmarks.processor import print_banner

    print_banner()  # the processor and kernel path every figure below ran on
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the timed steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / ".bench" / "engine_staggered.json")
    args = ap.parse_args()
    if not 1 <= args.min_len <= args.max_len:
        ap.error(f"--min-len {args.min_len} must be at least 1 and at most --max-len {args.max_len}")
    torch.manual_seed(args.seed)
    with tqdm(total=3 * len(args.dtypes), desc="engine, staggered contexts") as bar:
        rows = [bench_dtype(d, args, bar) for d in args.dtypes]
    text = report(rows, args)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "loadavg": os.getloadavg(),
                                    "rows": rows}, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
