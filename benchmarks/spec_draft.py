"""The draft-model proposer's costs (pdserve/engine/spec/draft.py), two questions of issue 57.

Where a draft's KV should come from on a decode worker: built there from the transferred prompt,
or transferred from the prefill pool beside the target's. ``catch-up`` measures the first's cost:
a fresh prompt's catch-up step through the draft proposer, per prompt token, next to the same
prompt through the target in the same runner, and the bytes per token a transfer of the draft's
KV would move instead.

What a draft buys at concurrency 1: ``tpot`` times one greedy request's tokens on an engine
without speculation and with each draft (time per output token after the first, and the
acceptance counters).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/spec_draft.py {catch-up,tpot} [--prompt-len 256] [--dtype bfloat16]

Target: the default model (SmolLM2-135M, 30 layers). Drafts: the target itself (the most a draft
can cost, and the best it can agree: the upper bound of acceptance) and the target cut to its
first 2 layers (a draft of the usual size ratio, 1/15 of the layers, which agrees far less).
One torch thread, as a worker runs on this machine; a catch-up figure is the best of ``--rounds``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig  # noqa: E402
from pdserve.engine.core.sequence import Sequence  # noqa: E402
from pdserve.engine.loader import materialize, read_model_config  # noqa: E402
from pdserve.engine.sampling.params import SamplingParams  # noqa: E402
from pdserve.engine.spec.draft import DraftProposer  # noqa: E402


def two_layer_smollm(directory: Path, source: Path) -> Path:
    """SmolLM2 cut to its first 2 layers (its embedding, final norm and head kept): a draft of
    the usual size ratio whose guesses come from the target's own weights."""
    from safetensors.torch import load_file, save_file

    config = json.loads((source / "config.json").read_text())
    config["num_hidden_layers"] = 2
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    tensors = {}
    for file in sorted(source.glob("*.safetensors")):
        for name, tensor in load_file(str(file)).items():
            layer = name.split(".layers.")[1].split(".")[0] if ".layers." in name else None
            if layer is None or int(layer) < 2:
                tensors[name] = tensor
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def catch_up_proposer(model_dir: Path, target_dir: Path, dtype: str) -> DraftProposer:
    config = EngineConfig(model=str(target_dir), dtype=dtype, device="cpu", cuda_graphs=False,
                          cache=CacheConfig(num_blocks=64))
    spec = SpeculativeConfig(method="draft_model", model=str(model_dir), num_speculative_tokens=1)
    return DraftProposer.from_config(spec, config, read_model_config(target_dir))


def catch_up_s(draft: DraftProposer, rid: str, prompt: list[int]) -> float:
    """Seconds of a fresh prompt's catch-up step (one guess: no single-token step follows)."""
    seq = Sequence(rid, list(prompt), SamplingParams())
    start = time.perf_counter()
    draft.propose([seq], 1)
    elapsed = time.perf_counter() - start
    draft.forget(rid)
    return elapsed


def tpot_engine(target: Path, dtype: str, spec: SpeculativeConfig | None):
    from pdserve.engine.llm_engine import LLMEngine

    config = EngineConfig(model=str(target), dtype=dtype, device="cpu", cuda_graphs=False, speculative=spec,
                          cache=CacheConfig(num_blocks=128), scheduler=SchedulerConfig(policy="mixed"))
    return LLMEngine.from_config(config, progress=False, detokenize=False)


def tpot_ms(engine, rid: str, prompt: list[int], max_tokens: int) -> float:
    """ms per output token after the first of one greedy request alone on ``engine``."""
    engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    first = last = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids:
                last = time.perf_counter()
                first = first or last
    return (last - first) / (max_tokens - 1) * 1000


def tpot(target: Path, small: Path, args) -> None:
    """Every engine loaded first, then rounds that run each in turn: a machine whose load drifts
    (this one is shared) weighs on every column alike. Each cell is the median over rounds."""
    drafts = [("none", None), ("SmolLM2-135M itself", target), ("its first 2 layers", small)]
    engines = [tpot_engine(target, args.dtype, None if d is None else SpeculativeConfig(
        method="draft_model", model=str(d), num_speculative_tokens=args.k)) for _, d in drafts]
    prompt = torch.randint(100, 40000, (args.prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    times: list[list[float]] = [[] for _ in engines]
    for r in range(args.rounds + 1):  # round 0 warms up
        for i, engine in enumerate(engines):
            ms = tpot_ms(engine, f"t{r}", prompt, args.max_tokens)
            if r:
                times[i].append(ms)
    print(f"one greedy request, {args.prompt_len}-token prompt, {args.max_tokens} tokens, {args.dtype}, 1 thread, "
          f"k = {args.k}, median of {args.rounds} interleaved rounds")
    print("| draft | TPOT ms | vs none | acceptance | mean accepted length |")
    print("|---|---|---|---|---|")
    base = statistics.median(times[0])
    for (name, _), engine, ts in zip(drafts, engines, times):
        stats = engine.spec_stats
        accepted = "" if stats is None else f"{stats.acceptance_rate:.2f} | {stats.mean_accepted_length:.2f}"
        print(f"| {name} | {statistics.median(ts):.1f} | {statistics.median(ts) / base:.2f} | "
              f"{accepted or ' | '} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["catch-up", "tpot"])
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = materialize("default", progress=False)
    with tempfile.TemporaryDirectory() as tmp:
        small = two_layer_smollm(Path(tmp) / "smollm-2-layers", target)
        if args.what == "catch-up":
            catch_up(target, small, args)
        else:
            tpot(target, small, args)


def catch_up(target: Path, small: Path, args) -> None:
    """Both proposers loaded first, then rounds that run each in turn; the best round each."""
    rows = [("SmolLM2-135M (target, and as its own draft)", target), ("its first 2 layers", small)]
    drafts = [catch_up_proposer(d, target, args.dtype) for _, d in rows]
    prompt = torch.randint(100, 40000, (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    best = [float("inf")] * len(drafts)
    for r in range(args.rounds + 1):  # round 0 warms up
        for i, draft in enumerate(drafts):
            elapsed = catch_up_s(draft, f"r{r}", prompt)
            best[i] = min(best[i], elapsed) if r else best[i]
    print(f"{args.prompt_len}-token prompt, {args.dtype}, 1 thread, best of {args.rounds} interleaved rounds")
    print("| model | ms per prompt token | vs the target | KV bytes per token |")
    print("|---|---|---|---|")
    for (name, _), draft, s in zip(rows, drafts, best):
        kv = draft.runner.cache[0].numel() * draft.runner.cache.element_size() // draft.blocks.block_size
        print(f"| {name} | {s * 1000 / args.prompt_len:.3f} | {s / best[0]:.2f} | {kv:,} |")


if __name__ == "__main__":
    main()
