"""What benchmarks/interference.py and benchmarks/conditional.py share: a local cluster in a
given mode, a minimal asyncio gRPC client that timestamps every token batch, and percentiles.

Not a load generator (benchmarks/loadgen.py is that): just enough to drive the two
comparisons in one process, so both arms of a comparison run with the same client.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pdserve.cluster.config import ClusterConfig  # noqa: E402
from pdserve.cluster.local import LocalCluster  # noqa: E402
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from pdserve.protos import pdserve_pb2, pdserve_pb2_grpc  # noqa: E402
from pdserve.router.limits import RouterLimits  # noqa: E402


@dataclass
class Stream:
    """One request as the client saw it: when it was sent, and when each token batch came."""

    prompt_tokens: int
    sent_at: float = 0.0
    times: list[float] = field(default_factory=list)  # one per response carrying tokens
    tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.times[0] - self.sent_at if self.times else None

    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:])]


def start(mode: str, num_prefill: int, num_decode: int, threads: int, dtype: str | None,
          max_num_batched_tokens: int, limits: RouterLimits = RouterLimits(), http: bool = False) -> LocalCluster:
    """A cluster started in this process (its HTTP API on any free port with ``http``). Workers are pinned to
    cores of their own by ``LocalCluster`` when the machine has a core for every thread."""
    engine = EngineConfig(dtype=dtype, cache=CacheConfig(memory_budget_bytes=512 << 20),
                          scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens))
    config = ClusterConfig(engine=engine, mode=mode, num_prefill=num_prefill, num_decode=num_decode,
                           grpc_port=0, http_port=0 if http else None, threads_per_worker=threads, supervise_interval_s=None,
                           router_limits=limits)
    cluster = LocalCluster(config)
    cluster.start()
    return cluster


def pinned_cores(cluster: LocalCluster) -> dict[str, list[int]]:
    """Each worker's CPU affinity as the kernel reports it (what pinning did)."""
    import ray

    out = {}
    for role in ("prefill", "decode"):
        for i, actor in enumerate(cluster.actors(role)):
            pid = ray.get(actor.pid.remote())
            out[f"{role}-{i}"] = sorted(os.sched_getaffinity(pid))
    return out


def random_prompt(length: int, seed: int) -> list[int]:
    return torch.randint(100, 49000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


async def run_stream(stub, prompt: list[int], max_tokens: int, record: Stream, stop: asyncio.Event | None = None,
                     timeout_s: float = 300.0) -> Stream:
    """Send one greedy request and timestamp its responses; ``stop`` set: cancel it."""
    request = pdserve_pb2.GenerateRequest(token_ids=pdserve_pb2.TokenIds(ids=prompt), sampling=pdserve_pb2.SamplingParams(
        max_tokens=max_tokens, ignore_eos=True))
    record.sent_at = time.monotonic()
    call = stub.Generate(request, timeout=timeout_s)
    try:
        async for resp in call:
            if resp.token_ids:
                record.times.append(time.monotonic())
                record.tokens += len(resp.token_ids)
            if stop is not None and stop.is_set():
                call.cancel()
                break
    except grpc.aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.CANCELLED:
            record.error = f"{exc.code().name}: {exc.details()}"
    return record


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def stub_for(cluster: LocalCluster):
    channel = grpc.aio.insecure_channel(cluster.address)
    return channel, pdserve_pb2_grpc.GenerationStub(channel)


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]
