"""The measured side of calibration (``calibrate.py --measure``): served runs against a
running cluster with the project's load generator, the probes of what serving adds to the
engine's own steps (``--serving-cost``), and the engine steps a run's workers traced
(``--step-trace``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pdserve.planner.cost import CostModel
from pdserve.planner.hardware import HardwareProfile
from pdserve.planner.model_spec import get_model


# --measure: the serving benchmark's two loads (random 256-token prompts, 64 output tokens,
# --ignore-eos): 2 req/s with 32 prompts, which saturates one prefill worker, and a closed loop
# of 16 clients with 48 prompts; and 0.5 req/s with 32 prompts, below saturation
MEASURE_LOADS = ({"request_rate": 0.5, "num_prompts": 32}, {"request_rate": 2.0, "num_prompts": 32},
                 {"max_concurrency": 16, "num_prompts": 48})


def measure(base_url: str, seed: int, trace_dir: str | None = None) -> dict:
    """Served runs against the cluster at ``base_url``, with the arrivals each one sent (and,
    with ``trace_dir``, the engine steps both workers ran during each: ``traced_steps``)."""
    import time

    from benchmarks.load import Arrivals, Lengths, WorkloadSpec, run
    from benchmarks.load.metrics import tpot, ttft

    runs = []
    for i, load in enumerate(MEASURE_LOADS):
        w = {**load, "input_len": 256, "output_len": 64, "seed": seed + i}
        closed = "max_concurrency" in w
        arrivals = (Arrivals("closed", concurrency=w["max_concurrency"]) if closed
                    else Arrivals("poisson", rate=w["request_rate"]))
        name = f"1P+1D, concurrency {w['max_concurrency']}" if closed else f"1P+1D, {w['request_rate']:g} req/s"
        spec = WorkloadSpec(num_requests=w["num_prompts"], arrivals=arrivals,
                            prompt_len=Lengths.fixed(w["input_len"]), output_len=Lengths.fixed(w["output_len"]),
                            seed=w["seed"])  # a seed per run: no prefix-cache hits from an earlier run
        res = run(spec, base_url)
        wall_end = time.time()  # the run's clock (perf_counter from its start) on the traces' (Unix time)
        if res.summary.failed:
            raise SystemExit(f"calibrate: {res.summary.failed} requests failed in {name}")
        records = sorted(res.records, key=lambda r: r.sent)
        t0 = records[0].sent
        window = (wall_end - res.summary.duration_s + t0, wall_end)  # first send to last token
        pick = lambda d: {"p50": d["p50"], "p90": d["p90"]}  # noqa: E731
        runs.append({"name": name, "layout": "1P:1D", "workload": w,
                     **({} if closed else {"arrivals_s": [r.sent - t0 for r in records]}),
                     # each request's own times, to set beside the simulated ones
                     "requests_ms": [{"ttft": 1e3 * ttft(r), "tpot": 1e3 * tpot(r)} for r in records],
                     "measured": {"ttft_ms": pick(res.summary.ttft_ms), "tpot_ms": pick(res.summary.tpot_ms)},
                     **({"traced_steps": traced_steps(trace_dir, *window)} if trace_dir else {})})
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return {"source": f"benchmarks/planner/calibrate.py --measure {base_url}, {stamp}: the project's load "
                      "generator, random 256-token prompts, 64 output tokens, ignore_eos", "runs": runs}


# The served probe: what serving adds to the engine's own steps, from the token times a client
# sees. Requests at batch 1 (256-token prompts, one at a time) and at batch 16 (short prompts,
# long outputs, so nearly every step of a request runs at the full batch), while a second
# client keeps the prefill worker busy with 256-token prompts (one output token each, so they
# add no decode work), as it is in the loads that saturate it. Between the first token (from
# the prefill worker) and the second (the decode worker's first step) lies the hand-off: the
# router asking the decode worker, the KV read, the sequence joining. Every later gap is one
# served decode step.
PROBE_PROMPT, PROBE_OUTPUT, PROBE_BATCH = 32, 128, 16


def _probe(base_url: str, batch: int, prompt: int, output: int, requests: int, seed: int, busy_decode: bool = False,
           alone: bool = False):
    """Records of ``requests`` requests, ``batch`` at a time, the prefill worker kept busy (or,
    with ``busy_decode``, the decode worker: eight short prompts with long answers; with
    ``alone``, neither: the worker's kernels borrow the idle one's core)."""
    import asyncio

    from benchmarks.load import Arrivals, Lengths, WorkloadSpec, run_async

    probe = WorkloadSpec(num_requests=requests, arrivals=Arrivals("closed", concurrency=batch),
                         prompt_len=Lengths.fixed(prompt), output_len=Lengths.fixed(output), seed=seed)
    busy = (WorkloadSpec(num_requests=10_000, arrivals=Arrivals("closed", concurrency=8), prompt_len=Lengths.fixed(16),
                         output_len=Lengths.fixed(512), seed=seed + 1, warmup=0) if busy_decode else
            WorkloadSpec(num_requests=10_000, arrivals=Arrivals("closed", concurrency=2),
                         prompt_len=Lengths.fixed(256), output_len=Lengths.fixed(1), seed=seed + 1, warmup=0))

    async def both():
        if alone:
            return (await run_async(probe, base_url)).records
        background = asyncio.ensure_future(run_async(busy, base_url, progress=False))
        await asyncio.sleep(2.0)  # the prefill worker is busy before the probe starts
        try:
            return (await run_async(probe, base_url)).records
        finally:
            background.cancel()
            await asyncio.gather(background, return_exceptions=True)

    return [r for r in asyncio.run(both()) if r.ok and len(r.chunk_times) == output]


def serving_cost(base_url: str, profile: HardwareProfile, seed: int) -> dict[str, float]:
    """What serving adds to the engine, in seconds: ``served_step_s`` and ``served_seq_s`` per
    decode step (solved from the served step at batch 1 and at batch 16 against the profile's
    steps there), ``kv_transfer_overhead_s``, the hand-off beyond the KV bytes over the link,
    and ``served_prefill_factor``, a served prefill's time over the profile's. And what the
    idle worker's core lends (``--borrow-idle-cores``): ``borrow_decode_factor``, the served
    step with the prefill worker idle over the step with it busy (the geometric mean over both
    batches), and ``borrow_prefill_factor``, a prompt's TTFT with the decode worker idle over
    its TTFT with it busy."""
    cost = CostModel(get_model("SmolLM2-135M"), profile, 1)
    extra, handoff, lent = {}, [], []
    # seeds of their own (each probe and its background client), and apart from every run's:
    # a prompt the prefix cache has seen would skip its prefill
    for batch, prompt, output, n, k in ((1, 256, 64, 8, 1), (PROBE_BATCH, PROBE_PROMPT, PROBE_OUTPUT, 32, 3)):
        records = _probe(base_url, batch, prompt, output, n, 10 * seed + k)
        step = _median_step(records)
        bare = cost.decode_s(batch, batch * (prompt + output // 2))
        extra[batch] = step - bare
        if batch == 1:  # the first gap is the hand-off plus one step
            handoff = [r.chunk_times[1] - r.chunk_times[0] - step for r in records]
        step_alone = _median_step(_probe(base_url, batch, prompt, output, n, 10 * seed + k + 6, alone=True))
        lent.append(step_alone / step)
        print(f"served probe, batch {batch}: decode step {step * 1e3:.1f} ms served, {bare * 1e3:.1f} ms in the "
              f"profile, {step_alone * 1e3:.1f} ms with the prefill worker idle"
              + (f"; hand-off {np.median(handoff) * 1e3:.1f} ms (median of {len(handoff)})" if batch == 1 else ""))
    per_seq = max(0.0, (extra[PROBE_BATCH] - extra[1]) / (PROBE_BATCH - 1))
    per_step = max(0.0, extra[1] - per_seq)
    link = max(0.0, float(np.median(handoff)) - (cost.transfer_s(256) - profile.kv_transfer_overhead_s))
    # A served prefill: 256-token prompts one at a time (one output token: no decode), the
    # decode worker busy on the other core, against the profile's prefill alone.
    records = _probe(base_url, 1, 256, 1, 6, 10 * seed + 5, busy_decode=True)
    ttft = _median_ttft(records)
    factor = max(1.0, ttft / cost.prefill_s([(256, 0)]))
    ttft_alone = _median_ttft(_probe(base_url, 1, 256, 1, 6, 10 * seed + 9, alone=True))
    print(f"served probe, prefill: 256 tokens in {ttft * 1e3:.0f} ms served (TTFT), "
          f"{cost.prefill_s([(256, 0)]) * 1e3:.0f} ms in the profile, {ttft_alone * 1e3:.0f} ms with the decode worker idle")
    return {"served_step_s": per_step, "served_seq_s": per_seq, "kv_transfer_overhead_s": link,
            "served_prefill_factor": factor, "borrow_prefill_factor": min(1.0, ttft_alone / ttft),
            "borrow_decode_factor": min(1.0, float(np.exp(np.mean(np.log(lent)))))}


def _median_step(records) -> float:
    """The median gap between a stream's tokens after its second: one served decode step."""
    return float(np.median([b - a for r in records for a, b in zip(r.chunk_times[1:], r.chunk_times[2:])]))


def _median_ttft(records) -> float:
    return float(np.median([r.chunk_times[0] - r.sent for r in records]))


# What ``calibrate.run_speed`` reads to find the machine's speed during a run.
def traced_steps(trace_dir: str, start: float, end: float) -> dict:
    """The steps each pool's workers ran between ``start`` and ``end`` (Unix seconds), as
    ``{"prefill": [[seconds, [[new, cached], ...], sampled], ...], "decode": [[seconds, batch,
    context], ...]}``; a decode worker's steps that ran prompt tokens are left out (the runs
    here have none: every prompt prefills on the prefill worker)."""
    from pdserve.engine.core.step_trace import read

    out: dict[str, list] = {"prefill": [], "decode": []}
    for pool in out:
        files = sorted(Path(trace_dir).glob(f"{pool}-*.steps.jsonl"))
        if not files:
            raise SystemExit(f"calibrate: no {pool} worker's step trace in {trace_dir}: start the cluster with "
                             f"--step-trace-dir {trace_dir}")
        for path in files:
            previous = None
            for step in read(path):
                seconds = step.seconds if step.after_idle or previous is None else step.end - previous.end
                previous = step
                if not start <= step.start <= end:
                    continue
                shape = step.shape
                if pool == "prefill":
                    out[pool].append([round(seconds, 7), [list(c) for c in shape.prefill], shape.sampled])
                elif not shape.prefill:
                    out[pool].append([round(seconds, 7), shape.decode_batch, shape.decode_context])
    return out
