"""Drive a server with a workload: warm-up, then the measured run (open or closed loop), with
a progress bar; returns every request's record and the summary.

Open loop: request i is sent at its offset from the start whether or not earlier ones ended
(optionally capped at ``max_concurrency`` in flight, as vllm bench serve does; a capped
request waits for a slot, which delays its send). Closed loop: ``concurrency`` clients each
send their next request as soon as their last one ended.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Awaitable, Callable, Sequence

import aiohttp
from tqdm import tqdm

from benchmarks.load.client import payload, send
from benchmarks.load.metrics import RequestRecord, Summary, summarize
from benchmarks.load.workload import Request, WorkloadSpec, build_requests, send_offsets

WARMUP_SEED_OFFSET = 7919  # warm-up prompts differ from the measured ones (no prefix-cache hits)


class LoadError(RuntimeError):
    """The server could not be used at all (no model listed, warm-up failed)."""


@dataclass(frozen=True)
class Results:
    spec: WorkloadSpec
    base_url: str
    model: str
    started: str  # ISO-8601 UTC
    records: tuple[RequestRecord, ...]
    summary: Summary
    prefixes: tuple[int | None, ...]  # which shared prefix each request began with

    def to_dict(self) -> dict:
        return {"schema": "pdserve-loadgen/1", "base_url": self.base_url, "model": self.model,
                "started": self.started, "spec": asdict(self.spec), "summary": asdict(self.summary),
                "records": [{**asdict(r), "prefix": p} for r, p in zip(self.records, self.prefixes)]}

    def to_json(self) -> str:
        return json.dumps(json_safe(self.to_dict()), indent=1)


def json_safe(x):
    """x with every NaN (a distribution with no values) as None and every infinity (a rate of
    "all at once") as the string "inf": strict JSON readers refuse NaN and Infinity."""
    if isinstance(x, float) and x != x:
        return None
    if isinstance(x, float) and math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


async def served_model(session: aiohttp.ClientSession, base_url: str) -> str:
    async with session.get(f"{base_url}/v1/models") as resp:
        if resp.status != 200:
            raise LoadError(f"GET {base_url}/v1/models answered {resp.status}")
        data = (await resp.json()).get("data") or []
    if not data:
        raise LoadError(f"GET {base_url}/v1/models lists no model")
    return data[0]["id"]


async def _open_loop(spec, requests, send_one, bar) -> list[RequestRecord]:
    offsets = send_offsets(spec.arrivals, len(requests), random.Random(spec.seed + 1))
    cap = spec.arrivals.max_concurrency
    slots = asyncio.Semaphore(cap) if cap else None
    start = time.perf_counter()

    async def one(req: Request, offset: float) -> RequestRecord:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        async with slots if slots else nullcontext():
            record = await send_one(req)
        bar.update(1)
        return record

    return list(await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets))))


async def _closed_loop(spec, requests, send_one, bar) -> list[RequestRecord]:
    records: list[RequestRecord | None] = [None] * len(requests)
    queue = iter(range(len(requests)))

    async def client() -> None:
        for i in queue:  # a shared iterator: each index goes to exactly one client
            records[i] = await send_one(requests[i])
            bar.update(1)

    await asyncio.gather(*(client() for _ in range(min(spec.arrivals.concurrency, len(requests)))))
    return records


async def run_async(spec: WorkloadSpec, base_url: str, progress: bool = True, api_key: str | None = None,
                    during: Callable[[str, str], Awaitable[asyncio.Future]] | None = None,
                    requests: Sequence[Request] | None = None) -> Results:
    """``run``'s coroutine. ``api_key``: sent as ``Authorization: Bearer`` with every request.
    ``requests``: these prompts and lengths instead of the spec's (the spec still gives the
    arrivals, the warm-up and the SLO; benchmarks/spec_decode.py's prompt set).
    ``during(base_url, model)``: awaited after the warm-up, it starts what runs alongside the
    measured requests and returns its task once that is under way; the task is cancelled when
    they end (benchmarks/load/flood.py)."""
    base_url = base_url.rstrip("/")
    url = f"{base_url}/v1/completions"
    connector = aiohttp.TCPConnector(limit=0)  # no client-side cap: the workload sets concurrency
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:
        model = spec.model or await served_model(session, base_url)
        for req in build_warmup(spec):
            record = await send(session, url, payload(model, req, spec.ignore_eos), time.perf_counter(),
                                spec.request_timeout_s)
            if not record.ok:
                raise LoadError(f"warm-up request failed: {record.error}")
        requests = list(requests) if requests is not None else build_requests(spec)
        t0 = time.perf_counter()

        def send_one(req: Request):
            return send(session, url, payload(model, req, spec.ignore_eos), t0, spec.request_timeout_s)

        started = datetime.now(timezone.utc).isoformat(timespec="seconds")
        loop = _open_loop if spec.arrivals.open_loop else _closed_loop
        beside = await during(base_url, model) if during is not None else None
        try:
            with tqdm(total=len(requests), desc="requests", unit="req", disable=not progress, leave=False) as bar:
                records = await loop(spec, requests, send_one, bar)
        finally:
            if beside is not None:
                beside.cancel()
                await asyncio.gather(beside, return_exceptions=True)
        duration = time.perf_counter() - t0
    return Results(spec, base_url, model, started, tuple(records), summarize(records, duration, spec.slo),
                   tuple(r.prefix for r in requests))


def build_warmup(spec: WorkloadSpec) -> list[Request]:
    return build_requests(spec, n=spec.warmup, seed_offset=WARMUP_SEED_OFFSET) if spec.warmup else []


def run(spec: WorkloadSpec, base_url: str, progress: bool = True, api_key: str | None = None,
        requests: Sequence[Request] | None = None) -> Results:
    """Run ``spec`` (or ``requests`` with its arrivals) against the OpenAI-compatible server at
    ``base_url`` (``http://host:port``, without ``/v1``) and return every request's record and
    the summary."""
    return asyncio.run(run_async(spec, base_url, progress, api_key, requests=requests))
