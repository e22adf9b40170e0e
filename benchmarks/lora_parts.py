"""What a step's LoRA products cost, part by part: the same decode step and prefill step with the
adapters' bytes, the step's rows and the number of adapters varied one at a time.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/lora_parts.py [--repeats 3] [--rank 16]

SmolLM2-135M in bfloat16, one torch thread, each step timed in this thread's CPU time (the
median of --steps decode steps; the prefill of --batch prompts of --prompt-len tokens). Two
engines: one with --max-loras 4 slots and four random adapters on all seven projections (the
served benchmark's), one with a single slot and one adapter. The kinds, alternated turn by turn
(best turn of each kept):

- ``base``: --batch streams of the base model (engine 4);
- ``four``: the streams round robin over the four adapters (engine 4; the served mix);
- ``one of four``: every stream on one adapter, engine 4 (its gather-free products still read
  and multiply all four slots: the bytes and multiply-adds of ``four``, the rows' slots alike);
- ``one slot``: every stream on the one adapter of the one-slot engine (a quarter of the bytes
  and of the gather-free multiply-adds, the same number of kernel calls); ``one-slot base``: that
  engine's base model (two engines' weights sit in different memory: compare each to its own);
- ``1 row``: one stream, base model and one adapter (engine 4): the calls' fixed cost, since a
  row's multiply-adds are a sixteenth of ``four``'s.

``--only KIND`` loops one kind's decode (``--prefill``: its prefill) for a profiler
(``py-spy record --native``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.lora import decode_tps, write_adapter  # noqa: E402
from pdserve.engine.config import CacheConfig, EngineConfig, LoRAConfig  # noqa: E402
from pdserve.engine.kernels import cpu_kernels  # noqa: E402
from pdserve.engine.llm_engine import LLMEngine  # noqa: E402
from pdserve.engine.loader import load_model, materialize, read_model_config  # noqa: E402

KINDS = ("base", "four", "one of four", "one slot", "one-slot base", "1 row base", "1 row adapter")


def make_engine(model_dir, modules, max_loras: int, rank: int, blocks: int) -> LLMEngine:
    config = EngineConfig(model=str(model_dir), dtype="bfloat16", device="cpu", cuda_graphs=False,
                          cache=CacheConfig(num_blocks=blocks, enable_prefix_cache=False),
                          lora=LoRAConfig(max_loras=max_loras, max_lora_rank=rank, modules=modules))
    model, model_cfg, _ = load_model(config.model, config.torch_dtype(), config.torch_device(), progress=False)
    return LLMEngine(model, model_cfg, config)


def runs(engines: dict, names: list[str], batch: int) -> dict:
    """Each kind's (engine, the adapter of each of its streams)."""
    four, one = engines[4], engines[1]
    return {"base": (four, [""] * batch), "four": (four, [names[n % 4] for n in range(batch)]),
            "one of four": (four, [names[0]] * batch), "one slot": (one, [names[0]] * batch),
            "one-slot base": (one, [""] * batch),
            "1 row base": (four, [""]), "1 row adapter": (four, [names[0]])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", choices=KINDS, default=None, help="loop this kind only (for a profiler)")
    ap.add_argument("--prefill", action="store_true", help="with --only: loop its prefill, not its decode")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model_dir = materialize("default", progress=False)
    cfg = read_model_config(model_dir)
    out = ROOT / ".bench" / "lora"
    modules = tuple((f"lora{k}", write_adapter(cfg, out / f"r{args.rank}-{k}", args.rank, k)) for k in range(4))
    blocks = (args.prompt_len + args.steps + 32) // 16 * args.batch + 64
    engines = {4: make_engine(model_dir, modules, 4, args.rank, blocks),
               1: make_engine(model_dir, modules[:1], 1, args.rank, blocks)}
    kinds = runs(engines, [name for name, _ in modules], args.batch)
    if args.only:
        engine, names = kinds[args.only]
        for r in range(10 ** 6):
            decode_tps(engine, names, args.prompt_len, 1 if args.prefill else args.steps, f"{args.only}{r}")
    decode: dict[str, list] = {k: [] for k in KINDS}
    prefill: dict[str, list] = {k: [] for k in KINDS}
    for r in range(args.repeats):
        for kind, (engine, names) in kinds.items():
            tps = decode_tps(engine, names, args.prompt_len, args.steps, f"{kind}{r}", prefill[kind])
            decode[kind].append(len(names) / tps)
    print(f"{cpu_kernels.cpu_model()} ({engines[4].runner.model.kernel_path}), 1 thread, rank {args.rank}, "
          f"{args.batch} streams, prompts of {args.prompt_len}; thread CPU ms, best of {args.repeats} "
          f"(load average {' '.join(f'{v:.1f}' for v in os.getloadavg())})")
    base_d, base_p = min(decode["base"]), min(prefill["base"])
    for kind in KINDS:
        d, p = min(decode[kind]), min(prefill[kind])
        extra = "" if kind.startswith("1 row") else f" (+{100 * (d / base_d - 1):.1f} %)"
        pre = "" if kind.startswith("1 row") else f", prefill {1e3 * p:.0f} ms (+{100 * (p / base_p - 1):.1f} %)"
        print(f"  {kind:14s} decode step {1e3 * d:6.2f} ms{extra}{pre}   turns "
              f"{' '.join(f'{1e3 * t:.2f}' for t in decode[kind])}")


if __name__ == "__main__":
    main()
