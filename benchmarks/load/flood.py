"""Tenant isolation under a flood (issue 41): one tenant's measured workload, run alone and then
again while a second tenant floods the server past its own limits (``--api-keys-file``,
docs/security.md#tenants). The measured tenant's TTFT p50 under the flood against alone says
how much the other's excess reaches it; the flood's 429s say the limits held it back.

The flood is a closed loop of ``concurrency`` clients, each sending the workload's kind of
request again as soon as its last one ended; after a refusal (429) a client waits what the
refusal's Retry-After says, as the OpenAI client libraries do (``pause_s`` set: that long
instead, whatever Retry-After says; 0 is a client that hammers). It runs in a process of its own: sharing
the measured client's event loop, its few hundred requests a second made that loop late to
stamp the measured tokens, and the ratio measured the client as much as the server (x1.48
with the flooder admitted once in the whole run, on a 2-core AMD EPYC).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import multiprocessing
import time
from dataclasses import dataclass

import aiohttp

from benchmarks.load.client import payload, send
from benchmarks.load.runner import Results, run_async
from benchmarks.load.workload import WorkloadSpec, build_requests

FLOOD_SEED_OFFSET = 104_729  # the flood's prompts share nothing with the measured ones
SECOND_RUN_SEED_OFFSET = 1  # the second measured run's prompts miss the first's prefix cache


@dataclass(frozen=True)
class FloodSpec:
    api_key: str  # the flooding tenant's key
    concurrency: int = 32
    pause_s: float | None = None  # after a 429: None honours its Retry-After


@dataclass(frozen=True)
class IsolationResult:
    alone: Results
    flooded: Results
    flood: dict[str, int]  # "ok", "refused" (429), "failed": the flood's answers

    @property
    def ttft_p50_ratio(self) -> float:
        """Flooded over alone; below 1.2 is issue 41's bar."""
        return self.flooded.summary.ttft_ms["p50"] / self.alone.summary.ttft_ms["p50"]

    def to_dict(self) -> dict:
        return {"schema": "pdserve-tenant-flood/1", "alone": self.alone.to_dict(), "flooded": self.flooded.to_dict(),
                "flood": self.flood, "ttft_p50_ratio": self.ttft_p50_ratio}

    def text(self) -> str:
        a, f = self.alone.summary, self.flooded.summary
        return (f"measured tenant TTFT p50: alone {a.ttft_ms['p50']:.1f} ms, under the flood "
                f"{f.ttft_ms['p50']:.1f} ms (x{self.ttft_p50_ratio:.2f}; failed {a.failed} / {f.failed})\n"
                f"flood: {self.flood['ok']} answered, {self.flood['refused']} refused (429), "
                f"{self.flood['failed']} failed otherwise")


async def flood(base_url: str, model: str, spec: WorkloadSpec, flooder: FloodSpec, counts: collections.Counter):
    """Send the flood until cancelled, counting answers into ``counts``."""
    requests = build_requests(spec, n=max(1, flooder.concurrency * 4), seed_offset=FLOOD_SEED_OFFSET)
    url = f"{base_url}/v1/completions"
    headers = {"Authorization": f"Bearer {flooder.api_key}"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=headers) as session:
        async def client(i: int) -> None:
            while True:
                req = requests[i % len(requests)]
                i += flooder.concurrency
                record = await send(session, url, payload(model, req, spec.ignore_eos), time.perf_counter(),
                                    spec.request_timeout_s)
                refused = record.error is not None and record.error.startswith("HTTP 429")
                counts["ok" if record.ok else "refused" if refused else "failed"] += 1
                if refused:
                    pause = flooder.pause_s if flooder.pause_s is not None else record.retry_after_s
                    await asyncio.sleep(pause if pause is not None else 1.0)

        await asyncio.gather(*(client(i) for i in range(flooder.concurrency)))


def _flood_process(base_url: str, model: str, spec: WorkloadSpec, flooder: FloodSpec, ready, stop, out) -> None:
    """The flood in a process of its own: ``ready`` is set at its first answer, it runs until
    ``stop`` is set, and its counts go to ``out``."""
    counts: collections.Counter = collections.Counter()

    async def until_stopped() -> None:
        task = asyncio.ensure_future(flood(base_url, model, spec, flooder, counts))
        while not stop.is_set():
            if counts:
                ready.set()
            await asyncio.sleep(0.02)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(until_stopped())
    out.put(dict(counts))


async def start_flood(base_url: str, model: str, spec: WorkloadSpec, flooder: FloodSpec,
                      counts: collections.Counter) -> asyncio.Future:
    """Start ``flood`` in another process and return, once it has had an answer, a task that
    keeps it going until cancelled; its counts then land in ``counts``."""
    ctx = multiprocessing.get_context("spawn")
    ready, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=_flood_process, args=(base_url, model, spec, flooder, ready, stop, out), daemon=True)
    proc.start()
    if not await asyncio.to_thread(ready.wait, 120):
        stop.set()
        raise RuntimeError("the flood process had no answer from the server in 120 s")

    async def until_cancelled() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            stop.set()
            counts.update(await asyncio.to_thread(out.get, True, 60))
            await asyncio.to_thread(proc.join, 10)

    return asyncio.ensure_future(until_cancelled())


async def isolation_async(spec: WorkloadSpec, base_url: str, api_key: str | None, flooder: FloodSpec,
                          progress: bool = True) -> IsolationResult:
    """The measured tenant's run alone, then again (other prompts) under the flood."""
    alone = await run_async(spec, base_url, progress, api_key)
    counts: collections.Counter = collections.Counter()
    second = dataclasses.replace(spec, seed=spec.seed + SECOND_RUN_SEED_OFFSET)
    flooded = await run_async(second, base_url, progress, api_key,
                              during=lambda url, model: start_flood(url, model, spec, flooder, counts))
    return IsolationResult(alone, flooded, {k: counts[k] for k in ("ok", "refused", "failed")})


def isolation(spec: WorkloadSpec, base_url: str, api_key: str | None, flooder: FloodSpec,
              progress: bool = True) -> IsolationResult:
    return asyncio.run(isolation_async(spec, base_url, api_key, flooder, progress))
