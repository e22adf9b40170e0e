"""The KV tier's measurement in the engine alone: benchmarks/kv_tier.py's traffic (a prefix
working set four times the KV memory, a cold pass, then shuffled revisits) against two
in-process engines, one with ``EngineConfig.kv_tier`` and one without, no serving path.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/kv_tier_engine.py [--prefixes 16] [--threads 1]

Both engines share the loaded model (the weights; each has its own KV cache of the size
benchmarks/kv_tier.py gives a worker) and take turns request by request, the order swapped
every request, so that outside load falls on both alike. TTFT here is from ``add_request`` to
the step that returns the first token; cached tokens are the engine's ``num_cached_tokens``.
The same report as the served benchmark's, and --out-dir/kv_tier_engine.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import processor  # noqa: E402
from benchmarks.kv_tier import BLOCK_SIZE, parse_args, report, sizes, summary, traffic  # noqa: E402
from benchmarks.serving_run import git_state  # noqa: E402
from pdserve.engine.config import CacheConfig, EngineConfig, KVTierConfig  # noqa: E402
from pdserve.engine.llm_engine import LLMEngine  # noqa: E402
from pdserve.engine.loader import load_model, materialize  # noqa: E402
from pdserve.engine.sampling.params import SamplingParams  # noqa: E402


def engines(args, size: dict, tier_dir: str) -> dict[str, LLMEngine]:
    model_dir = str(materialize(args.model, progress=False))
    num_blocks = size["kv_cache_memory"] // (size["kv_bytes_per_token"] * BLOCK_SIZE)
    base = EngineConfig(model=model_dir, dtype=args.dtype, device="cpu", cuda_graphs=False,
                        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks))
    model, model_cfg, _ = load_model(base.model, base.torch_dtype(), base.torch_device(), progress=False)
    tier = KVTierConfig(offload_bytes=size["kv_offload_bytes"], offload_dir=tier_dir)
    return {"no tier": LLMEngine(model, model_cfg, base),
            "tier": LLMEngine(model, model_cfg, dataclasses.replace(base, kv_tier=tier))}


def one(engine: LLMEngine, request_id: str, prompt: list[int], output_tokens: int) -> dict:
    """One request alone on ``engine``: TTFT and its cached prompt tokens."""
    sent, first, cached = time.perf_counter(), None, 0
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=output_tokens, ignore_eos=True))
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == request_id and out.new_token_ids and first is None:
                first, cached = time.perf_counter(), out.num_cached_tokens
    return {"ttft_s": first - sent, "prompt_tokens": len(prompt), "cached_tokens": cached}


def tier_counters(engine: LLMEngine) -> dict:
    tier = getattr(engine, "kv_tier", None)
    return {} if tier is None else dataclasses.asdict(tier.stats())


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads_per_worker)
    machine = processor.print_banner()
    size, (prefixes, order) = sizes(args), traffic(args)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    args.tier_root.mkdir(parents=True, exist_ok=True)
    doc = {"schema": "pdserve-kv-tier-engine/1", "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "git": git_state(), "machine": machine, "loadavg_before": os.getloadavg(), "argv": sys.argv[1:],
           "sizes": size, "threads": torch.get_num_threads(), "runs": {}}
    records: dict[str, list[dict]] = {"no tier": [], "tier": []}
    with tempfile.TemporaryDirectory(prefix="pdserve-kv-tier-bench-", dir=args.tier_root) as tier_dir:
        built = engines(args, size, tier_dir)
        for label, engine in built.items():  # warm-up: the first request of an engine is slower
            one(engine, f"warm-{label}", [7, 8, 9, 10] * 8, 2)
        rng, seen = random.Random(args.seed + 1), set()
        for i, which in enumerate(tqdm(order, desc="prefix visits (each to both engines)", unit="visit")):
            prompt = prefixes[which] + [rng.randrange(1000, 40000) for _ in range(args.question_tokens)]
            for label in list(built) if i % 2 == 0 else list(built)[::-1]:
                rec = one(built[label], f"{label}-{i}", prompt, args.output_tokens)
                records[label].append({"prefix": which, "revisit": which in seen, **rec})
            seen.add(which)
        for label, engine in built.items():
            doc["runs"][label] = {"summary": summary(records[label], args.prefix_tokens),
                                  "tier": tier_counters(engine), "records": records[label]}
            engine.close()
    doc["loadavg_after"] = os.getloadavg()
    off, on = doc["runs"]["no tier"]["summary"], doc["runs"]["tier"]["summary"]
    doc["ratios"] = {"ttft_p50_ratio": off["ttft_ms"]["p50"] / on["ttft_ms"]["p50"],
                     "tier_cached_share": on["cached_share"], "no_tier_cached_share": off["cached_share"]}
    (args.out_dir / "kv_tier_engine.json").write_text(json.dumps(doc, indent=1) + "\n")
    print("\n" + report(doc, counters=False))
    print(f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, engine level; load average before "
          f"{doc['loadavg_before'][0]:.1f}, after {doc['loadavg_after'][0]:.1f} (a shared machine); tier: "
          f"{doc['runs']['tier']['tier']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
