"""``pdserve profile``: measure our own engine on this machine and fit the ``cpu`` profile.

Prefill steps at several prompt lengths, and decode steps at every batch size from 16 down
to 1 at two context lengths, are timed on ``pdserve.engine.llm_engine.LLMEngine`` (one prompt per
prefill step, as a prefill worker runs them; medians of repeats, since this machine is
shared). Each point's work is known from the model's shape (``ModelSpec``): bytes read
(weights + KV), matmul FLOPs, and attention FLOPs (a prefill's causal pairs, a decode
step's context). The fit is a non-negative least squares

    t = overhead + sequences x per_sequence + bytes / bandwidth + matmul flops / flop_rate
        + prefill attention flops / its rate + decode attention flops / its rate

(one core does all of it, so the terms add: ``overlap=False``), with the bandwidth measured
apart, as one thread's read rate (``read_bandwidth``). Attention gets rates of its own
because its kernels are not the linears': fitted at the matmuls' rate, decode steps came out
up to 16% short at 512-token contexts and 14% long at 128, and a 2,048-token prefill 18%
short. A KV tier load is measured as files of one KV block each read, checksummed and copied
into a cache row (``tier_load_bandwidth``). The KV link is measured as a memcpy of a
cache-sized buffer, at 0.74x (NIXL's measured share of memcpy on this machine, BENCHMARKS.md
"KV transfer"), with a 2 ms fixed cost per transfer (the cluster's measured 2.1-6.4 ms at 512
tokens, BENCHMARKS.md "Share of time to first token").
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

from pdserve.planner.hardware import HardwareProfile
from pdserve.planner.model_spec import ModelSpec

NIXL_SHARE_OF_MEMCPY = 0.74
TRANSFER_OVERHEAD_S = 2e-3


@dataclass(frozen=True)
class Point:
    kind: str  # "prefill" | "decode"
    batch: int
    tokens: int  # prefill: prompt length; decode: context per sequence
    seconds: float


def work(spec: ModelSpec, dtype_bytes: int, p: Point) -> tuple[float, float, float, float]:
    """(bytes read, matmul FLOPs, prefill attention FLOPs, decode attention FLOPs) of one
    step: the regressors of the fit."""
    weights = spec.streamed_weight_bytes(p.batch * p.tokens if p.kind == "prefill" else p.batch, dtype_bytes)
    if p.kind == "prefill":
        pairs = p.batch * p.tokens * (p.tokens + 1) / 2
        matmul = p.batch * (p.tokens * spec.linear_flops_per_token + spec.lm_head_flops)
        return weights, matmul, pairs * spec.attention_flops_per_pair, 0.0
    context = p.batch * p.tokens
    nbytes = weights + context * spec.kv_bytes_per_token(dtype_bytes)
    matmul = p.batch * (spec.linear_flops_per_token + spec.lm_head_flops)
    return nbytes, matmul, 0.0, context * spec.attention_flops_per_pair


@dataclass(frozen=True)
class Fit:
    overhead_s: float
    seq_overhead_s: float
    mem_bw: float  # bytes/s
    flops: float  # FLOP/s of the matmuls
    prefill_attention_flops: float | None = None  # None: not fitted apart (attention at ``flops``)
    decode_attention_flops: float | None = None


# Columns of the fit: overhead, sequences, bytes, matmul FLOPs, prefill and decode attention FLOPs.
_FREE = 1e15  # a rate whose term the fit set to zero


def fit(spec: ModelSpec, dtype_bytes: int, points: list[Point], mem_bw: float | None = None,
        attention: bool = True) -> Fit:
    """Least squares in relative error (short steps count as much as long ones), every
    coefficient >= 0 (non-negative least squares by enumerating which terms are active).

    ``mem_bw``: the bandwidth measured apart (bytes/s), held fixed. With one model every
    step reads the same weights, so the fit alone cannot tell their time from a fixed step
    overhead; a measured bandwidth keeps that time where it belongs (and the profile usable
    for a model of another size). ``attention``: fit prefill's and decode's attention at
    rates of their own (else at the matmuls' rate)."""
    regs = np.array([(1.0, p.batch, *work(spec, dtype_bytes, p)) for p in points])
    if not attention:
        regs = np.column_stack([regs[:, :3], regs[:, 3:].sum(axis=1)])
    y = np.array([p.seconds for p in points])
    fixed = np.zeros(len(y))
    free = list(range(regs.shape[1]))
    if mem_bw is not None:
        fixed = regs[:, 2] / mem_bw
        free.remove(2)
    weighted = regs / y[:, None]  # relative error: divide each row by its measurement
    target = 1.0 - fixed / y
    scale = np.abs(weighted).max(axis=0)
    scale[scale == 0] = 1.0
    best, best_err = None, np.inf
    for keep in itertools.product((True, False), repeat=len(free)):
        cols = [c for c, k in zip(free, keep) if k]
        if 3 not in cols:
            continue  # matmul FLOPs always cost something
        coef, *_ = np.linalg.lstsq(weighted[:, cols] / scale[cols], target, rcond=None)
        if (coef < 0).any():
            continue
        full = np.zeros(regs.shape[1])
        full[cols] = coef / scale[cols]
        err = float(((weighted @ full - target) ** 2).sum())
        if err < best_err:
            best, best_err = full, err
    rate = lambda inv: float(1 / inv) if inv > 0 else _FREE  # noqa: E731
    bw = mem_bw if mem_bw is not None else rate(best[2])
    attn = (rate(best[4]), rate(best[5])) if attention else (None, None)
    return Fit(float(best[0]), float(best[1]), bw, rate(best[3]), *attn)


def _best_rate(nbytes: int, op, clock=time.perf_counter) -> float:
    """``nbytes`` over the fastest of five timed runs of ``op`` (after one untimed), on ``clock``."""
    op()
    times = []
    for _ in range(5):
        t = clock()
        op()
        times.append(clock() - t)
    return nbytes / min(times)


def memcpy_bandwidth(nbytes: int = 256 << 20, clock=time.perf_counter) -> float:
    import torch

    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    return _best_rate(nbytes, lambda: dst.copy_(src), clock)


def read_bandwidth(nbytes: int = 512 << 20, clock=time.perf_counter) -> float:
    """Bytes/s one thread streams from memory (a sum over a buffer far larger than the caches):
    the rate a decode step reads the weights at."""
    import torch

    x = torch.ones(nbytes // 4)
    return _best_rate(nbytes, x.sum, clock)


def tier_load_bandwidth(block_bytes: int, blocks: int = 256, directory: str | None = None) -> float:
    """Bytes/s a KV tier load moves on this machine: ``blocks`` files of ``block_bytes`` each
    (one per KV block, as the tier stores them) in a fresh directory under ``directory`` (None:
    the system's temporary directory, the tier's default place on a CPU host), page cache warm,
    each read whole, its XXH3-64 taken (the tier verifies every block it gives back) and copied
    into a cache row. The directory is removed after."""
    import shutil
    import tempfile

    import xxhash

    where = tempfile.mkdtemp(prefix="pdserve-tier-probe-", dir=directory)
    try:
        data = np.random.default_rng(0).integers(0, 256, block_bytes, dtype=np.uint8).tobytes()
        paths = [os.path.join(where, f"{i:016x}") for i in range(blocks)]
        for path in paths:
            Path(path).write_bytes(data)
        cache = np.zeros((blocks, block_bytes), dtype=np.uint8)  # (num_blocks, block_bytes), as the tier's view

        def load_all() -> None:
            for row, path in zip(cache, paths):
                with open(path, "rb") as f:
                    raw = f.read()
                xxhash.xxh3_64_intdigest(raw)
                row[:] = np.frombuffer(raw, dtype=np.uint8)

        return _best_rate(blocks * block_bytes, load_all)
    finally:
        shutil.rmtree(where, ignore_errors=True)


@dataclass(frozen=True)
class Sweep:
    """What ``measure`` times: one prompt at each of ``prefill_lens`` (``repeats`` times, the
    median kept), then decode steps of ``max_batch`` sequences down to 1 at each of ``contexts``
    (``decode_steps`` a batch size, the median kept)."""

    prefill_lens: tuple[int, ...]
    max_batch: int
    contexts: tuple[int, ...]
    repeats: int
    decode_steps: int
    # Time on the measuring thread's CPU clock instead of the wall's: a busy machine's other
    # processes then take nothing from the rates (one torch thread runs every kernel inline).
    cpu_time: bool = False

    def clock(self) -> float:
        return time.thread_time() if self.cpu_time else time.perf_counter()

    def points(self) -> int:
        """How many timings the sweep makes (its progress bar's length)."""
        return len(self.prefill_lens) * self.repeats + len(self.contexts) * self.max_batch


FULL = Sweep((64, 256, 512, 1024), 16, (128, 512), repeats=3, decode_steps=5)  # ``pdserve profile``: about a minute
QUICK = Sweep((32, 128, 256), 4, (64, 256), repeats=2, decode_steps=3)  # ``--quick``
# ``--layout auto``'s measurement at first start (planner/calibration.py), some 10 s on a quiet
# core: the fit's six terms need three prompt lengths (matmul against attention FLOPs) and two
# contexts (decode attention against the per-sequence cost); the lengths span the objective's
# 256-token prompts, and the batches the decode batches its rates reach (up to about 8 on two
# cores). On CPU time: the profile is cached for later starts, so it must hold the processor's
# rates, not the load of the minute it was taken in.
CALIBRATION = Sweep((64, 256, 512), 8, (128, 384), repeats=2, decode_steps=3, cpu_time=True)


def measure(engine, sweep: Sweep, progress: bool = True) -> list[Point]:
    """Prefill steps of one prompt at several lengths, and decode steps at every batch size
    from the largest down to 1 at each context length (the engine's step time is not linear
    in the batch: its kernels cut a batch into row tiles)."""
    from tqdm import tqdm

    bar = tqdm(total=sweep.points(), desc="profile", unit="point", disable=not progress)
    points = []
    for n in sweep.prefill_lens:
        times = []
        for r in range(sweep.repeats):
            times.append(_prefill_once(engine, n, f"p{n}-{r}", sweep.clock))
            bar.update(1)
        points.append(Point("prefill", 1, n, statistics.median(times)))
    for ctx in sweep.contexts:
        points += _decode_sweep(engine, sweep.max_batch, ctx, sweep.decode_steps, lambda: bar.update(1), sweep.clock)
    bar.close()
    return points


def _prompt(engine, n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(100, engine.model_cfg.vocab_size - 100, n).tolist()


def _prefill_once(engine, n: int, rid: str, clock=time.perf_counter) -> float:
    from pdserve.engine.sampling.params import SamplingParams

    engine.add_request(rid, _prompt(engine, n, hash(rid) % 2**31), SamplingParams(max_tokens=1, ignore_eos=True))
    t = clock()
    engine.step()
    elapsed = clock() - t
    while engine.has_unfinished():
        engine.step()
    return elapsed


def _decode_sweep(engine, max_batch: int, ctx: int, steps: int, progress, clock=time.perf_counter) -> list[Point]:
    """Decode steps of ``max_batch`` sequences of ``ctx``-token prompts, then of one fewer
    (one aborted) and so on down to 1: one prefill of the whole batch serves every batch size.
    Each point records the mean context the sequences held then (it grows by a token a step)."""
    from pdserve.engine.sampling.params import SamplingParams

    params = SamplingParams(max_tokens=(steps + 1) * max_batch + 4, ignore_eos=True)
    for i in range(max_batch):
        engine.add_request(f"d{ctx}-{i}", _prompt(engine, ctx, 7 * i + ctx), params)
    while engine.scheduler.waiting:
        engine.step()
    engine.step()
    points = []
    for batch in range(max_batch, 0, -1):
        while len(engine.scheduler.running) > batch:
            engine.abort(engine.scheduler.running[-1].seq_id)
        context = statistics.mean(seq.num_tokens for seq in engine.scheduler.running)
        times = []
        for _ in range(steps):
            t = clock()
            engine.step()
            times.append(clock() - t)
        points.append(Point("decode", batch, round(context), statistics.median(times)))
        progress()
    for seq in list(engine.scheduler.running):
        engine.abort(seq.seq_id)
    return points


def profile_engine(model: str = "default", dtype: str | None = None, threads: int = 1,
                   sweep: Sweep = FULL, progress: bool = True, label: str = "pdserve profile"
                   ) -> tuple[HardwareProfile, list[Point], ModelSpec]:
    """Measure the engine with ``sweep``; the fitted profile, the measured points and the
    model measured. ``label`` opens the profile's ``source`` (who measured it)."""
    import torch

    from pdserve.engine.config import CacheConfig, EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.loader import materialize
    from pdserve.planner.model_spec import spec_from_config

    if sweep.cpu_time and threads != 1:
        raise ValueError(f"threads: a sweep on CPU time times one thread, got {threads}")
    torch.set_num_threads(threads)
    config = EngineConfig(model=model, dtype=dtype, cache=CacheConfig())
    engine = LLMEngine.from_config(config)
    spec = spec_from_config(json.loads((materialize(model, progress=False) / "config.json").read_text()), model)
    dtype_bytes = engine.dtype.itemsize
    points = measure(engine, sweep, progress)
    f = fit(spec, dtype_bytes, points, mem_bw=read_bandwidth(clock=sweep.clock))
    link = memcpy_bandwidth(clock=sweep.clock) * NIXL_SHARE_OF_MEMCPY
    tier_bw = tier_load_bandwidth(int(spec.kv_bytes_per_token(dtype_bytes)) * config.cache.block_size)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = os.getloadavg()[0]  # a shared machine: the fit is only as quiet as the machine was
    profile = HardwareProfile(
        "cpu", peak_flops=f.flops, flops_efficiency=1.0, peak_mem_bw=f.mem_bw, mem_bw_efficiency=1.0,
        mem_bytes=spec.weight_bytes(dtype_bytes) + config.cache.exact_budget_bytes(), kv_link_bw=link,
        kv_transfer_overhead_s=TRANSFER_OVERHEAD_S, interconnect_bw=link, step_overhead_s=f.overhead_s,
        seq_overhead_s=f.seq_overhead_s, overlap=False, dtype_bytes=dtype_bytes,
        prefill_attention_flops=f.prefill_attention_flops, decode_attention_flops=f.decode_attention_flops,
        decode_points=tuple((p.batch, p.tokens, p.seconds) for p in points if p.kind == "decode"),
        points_model=spec.shape, kv_tier_bw=tier_bw,
        source=f"{label}, {stamp}: {model} {engine.dtype}, {threads} thread(s), {len(points)} points "
               f"fitted to t = overhead + seqs x per_seq + bytes/bw + matmul flops/rate + attention flops/"
               f"(prefill's, decode's rate), bw measured apart; on {'thread CPU' if sweep.cpu_time else 'wall'} "
               f"time; load average {load:.1f}")
    return profile, points, spec


def save_points(path: str | Path, points: list[Point], profile: HardwareProfile, spec: ModelSpec) -> None:
    """The measured points with the fitted model's prediction for each (for BENCHMARKS.md)."""
    from pdserve.planner.cost import CostModel

    cost = CostModel(spec, profile)
    rows = []
    for p in points:
        fitted = (cost.prefill_s([(p.tokens, 0)]) if p.kind == "prefill"
                  else cost.formula_decode_s(p.batch, p.batch * p.tokens))
        rows.append({"kind": p.kind, "batch": p.batch, "tokens": p.tokens, "measured_s": p.seconds, "fitted_s": fitted})
    Path(path).write_text(json.dumps(rows, indent=2) + "\n")
