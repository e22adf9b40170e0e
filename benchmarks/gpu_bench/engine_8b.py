"""Phase 1 of the GPU bench: Llama-3.1-8B's shape with dummy weights (``--load-format dummy``)
in one process.

- load: seconds to build the model in bfloat16 on the device, and the peak device memory
  while doing so against the weights' bytes (the issue's target: within 5%).
- decode: ms a step at each batch and context length, CUDA-graphed first (the figure the
  issue targets: within 1.3x of the floor at batch 1), then eager. The sequences arrive as a
  decode worker receives them (``add_prefilled`` + ``kv_ready``: blocks allocated, no prompt
  run), so an 8k context costs no prefill. The floor: the weights a step reads (the LM head
  and every layer; the embedding table only through one row a token) plus the running
  sequences' KV, over the datasheet's HBM bandwidth, and over the read bandwidth measured here.
- mixed: a decode worker's mixed step, 32 streams decoding and a prompt's 256-token chunk, ms
  graphed (everything but the attention from the piecewise graphs) and eager.
- prefill: ms for one prompt of each length (one chunk), best of two after a warm-up, and its
  MFU against the datasheet's dense bf16 peak. FLOPs: 2 a weight a token for every linear of
  the layers, the LM head for the last token only, and causal attention's 2 * N^2 * hidden
  a layer (QK^T and AV, half the square each).

A context or batch whose KV does not fit what the device has left is recorded as skipped,
with the bytes it needs, as is anything its budget (``--budget-s``) leaves no time for.
"""

from __future__ import annotations

import gc
import math
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.gpu_bench.common import (BLOCK_SIZE, Deadline, DeviceSpec, config_dir, device_name,  # noqa: E402
                                         device_spec, phase_main, read_gbs, synchronize)

WARMUP_STEPS = 3
TIMED_STEPS = 10
PROFILED_STEPS = 3  # after the timed ones, at the shapes PROFILED (step_profile.py)
PROFILED = ((1, 1024), (64, 1024), (1, 8192))  # (batch, context), graphed and eager
MIXED_ROWS, MIXED_CHUNK, TIMED_MIXED = 32, 256, 3  # issue 56's mixed step: 32 decoding rows and a 256-token chunk
GIB = 1 << 30
RESERVE_BYTES = 6 * GIB  # left free for activations, logits, graph pools and NIXL-free slack


def load(model_dir: Path, device, record):
    from pdserve.engine.loader import load_model

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    start = time.perf_counter()
    model, cfg, _ = load_model(str(model_dir), torch.bfloat16, device, progress=False, load_format="dummy")
    synchronize(device)
    seconds = time.perf_counter() - start
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    row = {"what": "load", "seconds": round(seconds, 2), "weight_bytes": weights,
           "params": sum(p.numel() for p in model.parameters())}
    if device.type == "cuda":
        row["peak_bytes"] = torch.cuda.max_memory_allocated(device) - base
        row["peak_over_weights"] = round(row["peak_bytes"] / weights, 4)
    record.add(row)
    return model, cfg


def engine_for(model, cfg, model_dir: Path, device, num_blocks: int, graphs: bool, settings):
    from pdserve.engine.config import MIXED, CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.engine.llm_engine import LLMEngine

    longest = max(max(settings.contexts) + WARMUP_STEPS + TIMED_STEPS + PROFILED_STEPS + 2, max(settings.prefill_tokens) + 2,
                  2 * MIXED_CHUNK + 2)
    config = EngineConfig(
        model=str(model_dir), dtype="bfloat16", device=device.type, cuda_graphs=graphs, max_model_len=longest,
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks, enable_prefix_cache=False),
        # A decode worker's policy: a prompt chunk of at most MIXED_CHUNK tokens beside the streams
        # (none in the decode and prefill rows: a step there decodes only, or prefills only).
        scheduler=SchedulerConfig(max_num_seqs=max(max(settings.batches), MIXED_ROWS + 1),
                                  max_num_batched_tokens=max(2048, max(settings.prefill_tokens)), policy=MIXED,
                                  mixed_prefill_tokens=MIXED_CHUNK))
    return LLMEngine(model, cfg, config, None, detokenize=False, model_dir=str(model_dir))


def blocks_for(batch: int, context: int) -> int:
    return batch * math.ceil((context + WARMUP_STEPS + TIMED_STEPS + PROFILED_STEPS + 2) / BLOCK_SIZE)


def mixed_blocks(context: int) -> int:
    """The mixed step's streams, and its prompt (twice the chunk, so it is cut)."""
    return blocks_for(MIXED_ROWS, context) + blocks_for(1, 2 * MIXED_CHUNK)


def cache_blocks(settings, block_bytes: int, device) -> int:
    """Blocks for the largest decode (or prefill) that fits what the device has left."""
    wanted = max([blocks_for(b, c) for b in settings.batches for c in settings.contexts]
                 + [blocks_for(1, n) for n in settings.prefill_tokens] + [mixed_blocks(min(settings.contexts))])
    if device.type != "cuda":
        return wanted
    free, _ = torch.cuda.mem_get_info(device)
    return max(1, min(wanted, (free - RESERVE_BYTES) // block_bytes))


def release(engine, model) -> None:
    """Let the engine's KV cache go: the model's attention layers keep the views of the cache
    they were last bound to, so they are bound to a one-block cache first (else the next
    engine's cache would be allocated beside this one)."""
    spare = engine.cache_spec.layer_caches(engine.cache_spec.allocate(1, engine.device))
    model.bind_caches(spare, engine.runner.backend)


def weights_read(model) -> int:
    """Bytes a decode step reads of the weights: all of them, less the embedding table when the
    LM head is its own matrix (a step looks up one row of the table a token)."""
    tied = model.lm_head.tied  # the head reads the embedding's rows: every row of it is read
    return sum(t.numel() * t.element_size() for name, t in model.state_dict().items()
               if tied or not name.startswith("embed_tokens"))


def decode_row(engine, batch: int, context: int, device, spec: DeviceSpec | None, read: float, weights: int,
               profiled: bool = False) -> list[dict]:
    """The step's row, and with ``profiled`` its kernel profile's row after it."""
    from benchmarks.gpu_bench.step_profile import profile_row
    from pdserve.engine.sampling.params import SamplingParams

    params = SamplingParams(max_tokens=WARMUP_STEPS + TIMED_STEPS + PROFILED_STEPS + 2, ignore_eos=True)
    ids = [f"d{batch}x{context}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        engine.add_prefilled(rid, [3 + (i * 7 + j) % 250 for j in range(context - 1)], 5, params)
        engine.kv_ready(rid)
    try:
        for _ in range(WARMUP_STEPS):
            engine.step()
        running = len(engine.scheduler.running)
        synchronize(device)
        start = time.perf_counter()
        for _ in range(TIMED_STEPS):
            engine.step()
        synchronize(device)
        ms = (time.perf_counter() - start) / TIMED_STEPS * 1e3
        kv = sum(s.num_computed_tokens for s in engine.scheduler.running) * engine.cache_spec.bytes_per_token
        floor = (weights + kv) / spec.hbm_bytes_per_s * 1e3 if spec is not None else None
        profile = profile_row(engine, device, PROFILED_STEPS, batch, context, ms, floor) if profiled else None
    finally:
        for rid in ids:
            engine.abort(rid)
    row = {"what": "decode", "batch": batch, "context": context, "cuda_graphs": engine.config.cuda_graphs,
           "attention_backend": engine.runner.backend.name, "running": running, "ms_per_step": round(ms, 3), "weight_bytes_read": weights, "kv_bytes_read": kv,
           "floor_ms_measured_bw": round((weights + kv) / (read * 1e9) * 1e3, 3)}
    if engine.config.cuda_graphs:  # None: no graphs were captured (an attention backend that is not graph-safe)
        row["graph_replays"] = getattr(engine.runner.graphs, "replays", None)
    if floor is not None:
        row["floor_ms_datasheet"] = round(floor, 3)
        row["step_over_floor"] = round(ms / row["floor_ms_datasheet"], 2)
    return [row] if profile is None else [row, profile]


def mixed_row(engine, device, context: int) -> dict:
    """A decode worker's mixed step: MIXED_ROWS streams at ``context`` decoding while a prompt's
    first MIXED_CHUNK tokens prefill, ms a step (best of TIMED_MIXED after a warm-up). With CUDA
    graphs everything but the attention replays from the piecewise graphs."""
    from pdserve.engine.sampling.params import SamplingParams

    params = SamplingParams(max_tokens=WARMUP_STEPS + TIMED_MIXED + 2, ignore_eos=True)
    ids = [f"m{context}-{i}" for i in range(MIXED_ROWS)]
    for i, rid in enumerate(ids):
        engine.add_prefilled(rid, [3 + (i * 11 + j) % 250 for j in range(context - 1)], 5, params)
        engine.kv_ready(rid)
    times = []
    try:
        for _ in range(WARMUP_STEPS):
            engine.step()
        for attempt in range(TIMED_MIXED + 1):
            prompt = f"m{context}-prompt-{attempt}"
            engine.add_request(prompt, [7 + (attempt * 13 + j) % 250 for j in range(2 * MIXED_CHUNK)],
                               SamplingParams(max_tokens=1, ignore_eos=True))
            synchronize(device)
            start = time.perf_counter()
            engine.step()  # the streams' tokens and the prompt's first chunk
            synchronize(device)
            if attempt:
                times.append(time.perf_counter() - start)
            engine.abort(prompt)
    finally:
        for rid in ids:
            engine.abort(rid)
    pieces = engine.runner.piecewise
    return {"what": "mixed", "rows": MIXED_ROWS, "chunk": MIXED_CHUNK, "context": context,
            "cuda_graphs": engine.config.cuda_graphs, "piecewise": pieces is not None,
            "piecewise_replays": None if pieces is None else pieces.replays, "ms": round(min(times) * 1e3, 3)}


def prefill_flops(cfg, tokens: int) -> float:
    h, layers, hd = cfg.hidden_size, cfg.num_layers, cfg.head_dim
    per_layer = h * cfg.num_heads * hd * 2 + h * cfg.num_kv_heads * hd * 2 + 3 * h * cfg.intermediate_size
    return 2.0 * tokens * per_layer * layers + 2.0 * h * cfg.vocab_size + 2.0 * layers * tokens ** 2 * cfg.num_heads * hd


def prefill_row(engine, cfg, tokens: int, device, spec: DeviceSpec | None, warm_up: bool) -> dict:
    from pdserve.engine.sampling.params import SamplingParams

    params = SamplingParams(max_tokens=1, ignore_eos=True)
    best = float("inf")
    for attempt in range(3 if warm_up else 2):  # a warm-up first (kernels, autotuning) for the first size
        engine.add_request(f"p{tokens}-{attempt}", [3 + (attempt * 31 + 7 * j) % 250 for j in range(tokens)], params)
        synchronize(device)
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        synchronize(device)
        if attempt or not warm_up:
            best = min(best, time.perf_counter() - start)
    flops = prefill_flops(cfg, tokens)
    row = {"what": "prefill", "tokens": tokens, "cuda_graphs": engine.config.cuda_graphs, "ms": round(best * 1e3, 3),
           "tokens_per_s": round(tokens / best),
           "flops": flops, "tflops_per_s": round(flops / best / 1e12, 2)}
    if spec is not None:
        row["mfu"] = round(flops / best / spec.bf16_flops, 4)
    return row


def decode_sweep(engine, settings, device, spec, read, weights, deadline, record) -> None:
    graphs = engine.config.cuda_graphs
    for context in settings.contexts:
        for batch in settings.batches:
            what = {"what": "decode", "batch": batch, "context": context, "cuda_graphs": graphs}
            need = blocks_for(batch, context)
            if need > engine.blocks.num_blocks:
                record.skip(what, f"KV needs {need * engine.cache_spec.block_bytes / GIB:.1f} GiB; the cache holds "
                                  f"{engine.blocks.num_blocks * engine.cache_spec.block_bytes / GIB:.1f} GiB")
            elif deadline.left() < 10:
                record.skip(what, "out of time")
            else:
                profiled = (batch, context) in PROFILED or (batch, context) == (min(settings.batches), min(settings.contexts))
                for row in decode_row(engine, batch, context, device, spec, read, weights, profiled):
                    record.add(row)


def prefill_sweep(engine, cfg, settings, device, spec, deadline, record) -> None:
    for i, tokens in enumerate(settings.prefill_tokens):
        if deadline.left() < 10:
            record.skip({"what": "prefill", "tokens": tokens}, "out of time")
        elif blocks_for(1, tokens) > engine.blocks.num_blocks:
            record.skip({"what": "prefill", "tokens": tokens}, "the KV cache is too small")
        else:
            record.add(prefill_row(engine, cfg, tokens, device, spec, warm_up=i == 0))


def run(args, settings, record) -> None:
    device = torch.device(settings.device)
    name = device_name(device)
    spec = device_spec(name)
    record.set(device=name, datasheet=spec.__dict__ if spec else None)
    deadline = Deadline(args.budget_s)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = config_dir(Path(tmp) / f"llama-{settings.shape}", settings.hf_config, tokenizer=False)
        model, cfg = load(model_dir, device, record)
        read = read_gbs(device)
        weights = weights_read(model)
        record.set(read_gb_per_s=round(read, 1))
        for graphs in (True, False):
            if graphs and device.type != "cuda":
                record.skip({"what": "decode", "cuda_graphs": True}, "CUDA graphs need CUDA")
                continue
            from pdserve.engine.attention.kv_cache import cache_spec_of

            block_bytes = cache_spec_of(cfg, BLOCK_SIZE, torch.bfloat16).block_bytes
            engine = engine_for(model, cfg, model_dir, device, cache_blocks(settings, block_bytes, device), graphs,
                                settings)
            # With graphs a prompt of up to 2,048 tokens runs from the piecewise graphs; longer, eagerly.
            prefill_sweep(engine, cfg, settings, device, spec, deadline, record)
            decode_sweep(engine, settings, device, spec, read, weights, deadline, record)
            context = min(settings.contexts)
            if deadline.left() < 10 or mixed_blocks(context) > engine.blocks.num_blocks:
                record.skip({"what": "mixed", "cuda_graphs": graphs}, "out of time or KV")
            else:
                record.add(mixed_row(engine, device, context))
            release(engine, model)
            del engine
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(phase_main(run))
