"""What a KV tier load costs the engine thread: a prompt whose prefix blocks all went down to the
tier comes back in ``BlockManager.allocate`` (the scheduler's call, on the engine thread, inside
a step), so its loads are time every other sequence of that step waits.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/kv_tier_load.py [--tokens 2048] [--dir /dev/shm]

No model: a CPU cache of the default model's block (SmolLM2-135M in bfloat16: 16 tokens x 30
layers x K and V x 3 heads x 64 dims, 368,640 bytes), random bytes, a block manager and a
``KVTier`` as an engine builds them. Each round computes nothing: it registers the prompt's
blocks final, frees them, evicts them with another sequence (the tier writes their files; the
first round writes them, later ones find them stored), waits for the writer, then times the
prompt's ``allocate`` (every block but the last one's loaded, read from its file and verified);
then the same with the blocks read ahead first (``BlockManager.prefetch``, the reader thread),
so that ``allocate`` copies them from memory. Prints the median and the range over the rounds.

``--engine``: the default model in bfloat16 (one torch thread, the mixed policy a decode worker
runs), a stream decoding, two 2,048-token prompts computed once; then revisits, each loading
its prompt from the tier beside the stream (each revisit evicts the other prompt's blocks),
alternately without and with read-ahead (``KVTier.read_ahead``). Per revisit: its steps' times
from ``add_request`` to its first token, against the stream's decode step alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from pdserve.engine.config import MIXED, CacheConfig, EngineConfig, KVTierConfig, SchedulerConfig  # noqa: E402
from pdserve.engine.llm_engine import LLMEngine  # noqa: E402
from pdserve.engine.loader import load_model, materialize  # noqa: E402
from pdserve.engine.sampling.params import SamplingParams  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pdserve.engine.core.block_manager import BlockManager  # noqa: E402
from pdserve.engine.kv_tier.tier import KVTier  # noqa: E402

BLOCK_SIZE = 16
BLOCK_SHAPE = (BLOCK_SIZE, 30, 2, 3, 64)  # SmolLM2-135M's block, as pdserve's cache lays it out


def one_round(bm: BlockManager, tier: KVTier, prompt: list[int], filler: list[int], r: str,
              ahead: bool) -> tuple[float, int]:
    """Seconds ``allocate`` of ``prompt`` took with all its blocks in the tier (``ahead``: read
    ahead first, as the scheduler lets a queued prompt's be), and the blocks it loaded."""
    loaded = bm.tier_hits
    bm.allocate(f"fill{r}", filler)  # hands out every block: the prompt's go down to the tier
    bm.free(f"fill{r}")
    tier.flush()
    if ahead:
        bm.prefetch(f"p{r}", prompt)
        while bm.tier_fetching(f"p{r}"):
            time.sleep(0.001)
    started = time.perf_counter()
    bm.allocate(f"p{r}", prompt)
    seconds = time.perf_counter() - started
    bm.mark_final(f"p{r}", prompt, len(prompt))
    bm.free(f"p{r}")
    return seconds, (bm.tier_hits - loaded) // BLOCK_SIZE


def steps_until(engine: LLMEngine, request_id: str) -> list[float]:
    """Step ``engine`` until ``request_id`` has a token: each step's seconds."""
    times = []
    while True:
        started = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - started)
        if any(o.request_id == request_id and o.new_token_ids for o in outs):
            return times


def engine_revisits(where: str, revisits: int) -> None:
    config = EngineConfig(model=str(materialize("default", progress=False)), dtype="bfloat16", device="cpu",
                          cuda_graphs=False, cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=140),
                          scheduler=SchedulerConfig(policy=MIXED), kv_tier=KVTierConfig(1 << 31, where))
    torch.set_num_threads(1)
    model, model_cfg, _ = load_model(config.model, config.torch_dtype(), config.torch_device(), progress=False)
    engine = LLMEngine(model, model_cfg, config)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 40000, (2048,), generator=g).tolist() for _ in range(2)]
    engine.add_request("stream", list(range(200, 232)), SamplingParams(max_tokens=5000, ignore_eos=True))
    for i, prompt in enumerate(prompts):
        engine.add_request(f"cold{i}", prompt, SamplingParams(max_tokens=1))
        steps_until(engine, f"cold{i}")
    results: dict[bool, list[tuple[float, float, float]]] = {False: [], True: []}
    for r in range(revisits):
        ahead = engine.kv_tier.read_ahead = r % 2 == 1
        engine.kv_tier.flush()
        decode = statistics.median(steps_until(engine, "stream")[0] for _ in range(5))
        engine.add_request(f"again{r}", prompts[r % 2], SamplingParams(max_tokens=1))
        times = steps_until(engine, f"again{r}")
        results[ahead].append((max(times), sum(times), decode))
        print(f"  read-ahead {ahead}: steps {[round(t * 1e3) for t in times]} ms, decode step {decode * 1e3:.0f} ms",
              flush=True)
    for ahead, rows in results.items():
        print(f"read-ahead {ahead}: {len(rows)} revisits, medians: longest step {statistics.median(r[0] for r in rows) * 1e3:.0f} ms, "
              f"add to first token {statistics.median(r[1] for r in rows) * 1e3:.0f} ms, "
              f"decode step alone {statistics.median(r[2] for r in rows) * 1e3:.0f} ms; load avg {os.getloadavg()[0]:.1f}")
    engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048, help="prompt tokens (whole blocks)")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the tier's directory goes")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--engine", action="store_true", help="revisits through an engine of the default model")
    args = parser.parse_args()
    if args.engine:
        with tempfile.TemporaryDirectory(dir=args.dir, prefix="pdserve-tier-load-") as where:
            engine_revisits(where, 2 * args.rounds)
        return
    blocks = args.tokens // BLOCK_SIZE
    cache = torch.randint(-(1 << 15), 1 << 15, (blocks + 1, *BLOCK_SHAPE), dtype=torch.int16).view(torch.bfloat16)
    prompt = list(range(1000, 1000 + args.tokens))
    filler = list(range(100_000, 100_000 + (blocks + 1) * BLOCK_SIZE))
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="pdserve-tier-load-") as where:
        tier = KVTier(cache, where, 1 << 34, read_ahead=True)  # on, as next to a GPU
        bm = BlockManager(blocks + 1, BLOCK_SIZE)
        bm.attach_tier(tier)
        bm.allocate("p", prompt)
        bm.mark_final("p", prompt, len(prompt))
        bm.free("p")
        block_bytes = cache[0].numel() * cache.element_size()
        print(f"{args.tokens}-token prompt, blocks of {block_bytes} bytes, tier in {args.dir}, "
              f"{os.cpu_count()} cpus, load avg {os.getloadavg()[0]:.1f}")
        for ahead, what in ((False, "from files"), (True, "read ahead")):
            times, counts = zip(*(one_round(bm, tier, prompt, filler, f"{r}{ahead}", ahead) for r in range(args.rounds)))
            ms = sorted(t * 1e3 for t in times)
            print(f"  {what}: {counts[0]} blocks loaded in allocate, median {statistics.median(ms):.1f} ms "
                  f"(min {ms[0]:.1f}, max {ms[-1]:.1f}), {statistics.median(ms) * 1e3 / counts[0]:.0f} us a block, "
                  f"{counts[0] * block_bytes / statistics.median(times) / 1e9:.2f} GB/s")
        tier.close()


if __name__ == "__main__":
    main()
