"""``pdserve profile``: measure our own engine on this machine and fit the ``cpu`` profile.

Prefill steps at several prompt lengths and decode steps at several batch sizes and context
lengths are timed on ``engine.llm_engine.LLMEngine`` (one prompt per prefill step, as a
prefill worker runs them; median of repeats, since this machine is shared). Each point's
work is known from the model's shape (``ModelSpec``): bytes read (weights + KV) and FLOPs
(matmuls + attention). The fit is a non-negative least squares

    t = overhead + sequences x per_sequence + bytes / bandwidth + flops / flop_rate

(one core does both, so they add: ``overlap=False``). The KV link is measured as a memcpy
of a cache-sized buffer, at 0.74x (NIXL's measured share of memcpy on this machine,
BENCHMARKS.md "KV transfer"), with a 2 ms fixed cost per transfer (the cluster's measured
2.1-6.4 ms at 512 tokens, BENCHMARKS.md "Share of time to first token").
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from planner.hardware import HardwareProfile
from planner.model_spec import ModelSpec

NIXL_SHARE_OF_MEMCPY = 0.74
TRANSFER_OVERHEAD_S = 2e-3


@dataclass(frozen=True)
class Point:
    kind: str  # "prefill" | "decode"
    batch: int
    tokens: int  # prefill: prompt length; decode: context per sequence
    seconds: float


def work(spec: ModelSpec, dtype_bytes: int, p: Point) -> tuple[float, float]:
    """(bytes read, FLOPs) of one step: the regressors of the fit."""
    weights = spec.weight_bytes(dtype_bytes)
    if p.kind == "prefill":
        pairs = p.tokens * (p.tokens + 1) / 2
        flops = p.tokens * spec.linear_flops_per_token + pairs * spec.attention_flops_per_pair + spec.lm_head_flops
        return weights, flops
    context = p.batch * p.tokens
    nbytes = weights + context * spec.kv_bytes_per_token(dtype_bytes)
    flops = p.batch * (spec.linear_flops_per_token + spec.lm_head_flops) + context * spec.attention_flops_per_pair
    return nbytes, flops


@dataclass(frozen=True)
class Fit:
    overhead_s: float
    seq_overhead_s: float
    mem_bw: float  # bytes/s
    flops: float  # FLOP/s


def fit(spec: ModelSpec, dtype_bytes: int, points: list[Point]) -> Fit:
    """Least squares in relative error (short steps count as much as long ones), every
    coefficient >= 0 (non-negative least squares by enumerating which terms are active)."""
    rows = np.array([(1.0, p.batch, *work(spec, dtype_bytes, p)) for p in points])
    y = np.array([p.seconds for p in points])
    weighted = rows / y[:, None]  # relative error: divide each row by its measurement
    scale = np.abs(weighted).max(axis=0)
    best, best_err = None, np.inf
    for keep in itertools.product((True, False), repeat=4):
        cols = [i for i in range(4) if keep[i]]
        if 3 not in cols:
            continue  # FLOPs always cost something
        coef, *_ = np.linalg.lstsq(weighted[:, cols] / scale[cols], np.ones(len(y)), rcond=None)
        if (coef < 0).any():
            continue
        full = np.zeros(4)
        full[cols] = coef / scale[cols]
        err = float(((weighted @ full - 1.0) ** 2).sum())
        if err < best_err:
            best, best_err = full, err
    overhead, per_seq, inv_bw, inv_flops = best
    return Fit(float(overhead), float(per_seq), float(1 / inv_bw) if inv_bw > 0 else 1e15, float(1 / inv_flops))


def memcpy_bandwidth(nbytes: int = 256 << 20) -> float:
    import torch

    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    dst.copy_(src)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return nbytes / min(times)


def measure(engine, quick: bool) -> list[Point]:
    from tqdm import tqdm

    prefill_lens = (32, 128, 256) if quick else (64, 256, 512, 1024)
    decode_grid = list(itertools.product((1, 4) if quick else (1, 2, 4, 8, 16), (64, 256) if quick else (128, 512)))
    repeats = 2 if quick else 3
    bar = tqdm(total=len(prefill_lens) * repeats + len(decode_grid), desc="profile", unit="point")
    points = []
    for n in prefill_lens:
        times = []
        for r in range(repeats):
            times.append(_prefill_once(engine, n, f"p{n}-{r}"))
            bar.update(1)
        points.append(Point("prefill", 1, n, statistics.median(times)))
    for batch, ctx in decode_grid:
        points.append(Point("decode", batch, ctx, _decode(engine, batch, ctx, steps=3 if quick else 5)))
        bar.update(1)
    bar.close()
    return points


def _prompt(engine, n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(100, engine.model_cfg.vocab_size - 100, n).tolist()


def _prefill_once(engine, n: int, rid: str) -> float:
    from engine.sampling import SamplingParams

    engine.add_request(rid, _prompt(engine, n, hash(rid) % 2**31), SamplingParams(max_tokens=1, ignore_eos=True))
    t = time.perf_counter()
    engine.step()
    elapsed = time.perf_counter() - t
    while engine.has_unfinished():
        engine.step()
    return elapsed


def _decode(engine, batch: int, ctx: int, steps: int) -> float:
    from engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=steps + 4, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"d{batch}-{ctx}-{i}", _prompt(engine, ctx, 7 * i + ctx), params)
    while engine.scheduler.waiting:
        engine.step()
    engine.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    while engine.has_unfinished():
        engine.step()
    return statistics.median(times)


def profile_engine(model: str = "default", dtype: str | None = None, threads: int = 1,
                   quick: bool = False) -> tuple[HardwareProfile, list[Point], ModelSpec]:
    """Measure the engine; the fitted profile, the measured points and the model measured."""
    import torch

    from engine.config import CacheConfig, EngineConfig
    from engine.llm_engine import LLMEngine
    from planner.model_spec import spec_from_config

    torch.set_num_threads(threads)
    config = EngineConfig(model=model, dtype=dtype, cache=CacheConfig())
    engine = LLMEngine.from_config(config)
    spec = spec_from_config(engine.model_cfg, model)
    dtype_bytes = engine.dtype.itemsize
    points = measure(engine, quick)
    f = fit(spec, dtype_bytes, points)
    link = memcpy_bandwidth() * NIXL_SHARE_OF_MEMCPY
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = os.getloadavg()[0]  # a shared machine: the fit is only as quiet as the machine was
    profile = HardwareProfile(
        "cpu", peak_flops=f.flops, flops_efficiency=1.0, peak_mem_bw=f.mem_bw, mem_bw_efficiency=1.0,
        mem_bytes=spec.weight_bytes(dtype_bytes) + config.cache.memory_budget_bytes, kv_link_bw=link,
        kv_transfer_overhead_s=TRANSFER_OVERHEAD_S, interconnect_bw=link, step_overhead_s=f.overhead_s,
        seq_overhead_s=f.seq_overhead_s,
        overlap=False, dtype_bytes=dtype_bytes,
        source=f"pdserve profile, {stamp}: {model} {engine.dtype}, {threads} thread(s), {len(points)} points "
               f"fitted to t = overhead + seqs x per_seq + bytes/bw + flops/rate; load average {load:.1f}")
    return profile, points, spec


def save_points(path: str | Path, points: list[Point], profile: HardwareProfile, spec: ModelSpec) -> None:
    """The measured points with the fitted model's prediction for each (for BENCHMARKS.md)."""
    from planner.cost import CostModel

    cost = CostModel(spec, profile)
    rows = []
    for p in points:
        fitted = cost.prefill_s([(p.tokens, 0)]) if p.kind == "prefill" else cost.decode_s(p.batch, p.batch * p.tokens)
        rows.append({"kind": p.kind, "batch": p.batch, "tokens": p.tokens, "measured_s": p.seconds, "fitted_s": fitted})
    Path(path).write_text(json.dumps(rows, indent=2) + "\n")
