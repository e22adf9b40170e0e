"""Greedy tokens of every family, dtype, kernel path and TP size, to compare two checkouts.

A refactor of the model code must not move a single served token. This writes, for a fixed set
of models (the default model and a small random model of each family, built once by
``--build`` from the test suite's builders), the greedy tokens the engine produces in float32
and bfloat16, at TP 1 and 2, batched, on the kernel path ``PDSERVE_CPU_ISA`` names. Run it from
two checkouts over the same model directory and compare the JSON files (``--compare``)::

    python scripts/token_fingerprint.py --build /tmp/fp-models
    PDSERVE_CPU_ISA=avx2 PYTHONPATH=OLD python scripts/token_fingerprint.py --run /tmp/fp-models --out old-avx2.json
    PDSERVE_CPU_ISA=avx2 PYTHONPATH=NEW python scripts/token_fingerprint.py --run /tmp/fp-models --out new-avx2.json
    python scripts/token_fingerprint.py --compare old-avx2.json new-avx2.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPTS = [[1, 5, 9, 77, 31, 4], [1, 200, 13], [1, 42, 42, 42, 42, 7, 300, 2, 18, 99, 5], [1, 8]]
TP2 = ("llama", "qwen3")  # the families also run at two ranks


def build(out: Path) -> None:
    """The models, saved as safetensors directories under ``out`` (the test suite's builders)."""
    from tests.deepseek_models import make_deepseek
    from tests.factories import make_hf_model, save_hf_model
    from tests.families import save_family_model

    out.mkdir(parents=True, exist_ok=True)
    save_hf_model(make_hf_model("llama", seed=3), out / "llama")
    save_hf_model(make_hf_model("qwen2", seed=4, attention_bias=True), out / "qwen2")
    save_family_model("qwen3", out / "qwen3", seed=5)
    save_family_model("qwen3-moe", out / "qwen3_moe", seed=6)
    save_hf_model(make_deepseek("v2-lite", seed=7), out / "deepseek_v2")
    save_hf_model(make_deepseek("v3", seed=8), out / "deepseek_v3")


def run(models: Path) -> dict[str, list[list[int]]]:
    import torch

    from pdserve.engine.config import CacheConfig, EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sampling.params import SamplingParams

    torch.set_num_threads(2)
    found: dict[str, list[list[int]]] = {}
    dirs = ["default"] + sorted(str(d) for d in models.iterdir() if (d / "config.json").exists())
    for model in dirs:
        name = Path(model).name
        for dtype in ("float32", "bfloat16"):
            for tp in (1, 2) if name in TP2 else (1,):
                config = EngineConfig(model=model, dtype=dtype, device="cpu", tensor_parallel_size=tp,
                                      cache=CacheConfig(num_blocks=256))
                engine = LLMEngine.from_config(config, progress=False, detokenize=False,
                                               on_rank_lost=lambda exc: None)
                try:
                    out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
                finally:
                    close = getattr(engine, "close", None)
                    if close is not None:
                        close()
                found[f"{name}/{dtype}/tp{tp}"] = [list(c.token_ids) for c in out]
                print(f"{name} {dtype} tp{tp}: {found[f'{name}/{dtype}/tp{tp}'][0][:8]}...", flush=True)
    return found


def compare(a: Path, b: Path) -> int:
    """0 when the two records hold the same tokens for the same runs."""
    old, new = (json.loads(p.read_text())["runs"] for p in (a, b))
    differ = [k for k in old if k in new and old[k] != new[k]]
    missing = sorted(set(old) ^ set(new))
    print(f"{len(old)} runs in {a.name}, {len(new)} in {b.name}: {len(differ)} differ, {len(missing)} not in both")
    for k in differ + missing:
        print(f"  {k}")
    return 1 if differ or missing else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", type=Path)
    ap.add_argument("--run", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--compare", type=Path, nargs=2)
    args = ap.parse_args()
    if args.build:
        build(args.build)
    if args.run:
        found = run(args.run)
        record = {"isa": os.environ.get("PDSERVE_CPU_ISA", "auto"), "runs": found}
        args.out.write_text(json.dumps(record, indent=1))
    if args.compare:
        return compare(*args.compare)
    return 0


if __name__ == "__main__":
    sys.exit(main())
