"""The router records each request's metrics however it ends, against fake workers; the pool
publishes per-pool gauges and the workers' scrape targets from their last stats."""

import asyncio
import time
from types import SimpleNamespace

import grpc
import pytest

from pdserve.protos import pdserve_pb2, worker_pb2
from pdserve.router.frontend import ModelInfo
from pdserve.router.errors import RouteError
from pdserve.router.limits import RouterLimits
from pdserve.router.service import GenerationService
from pdserve.router.pool import PoolLoad, WorkerClient, WorkerPool, pool_loads
from tests.metrics.metrics_helpers import (FakeDecode, FakePrefill, LetterTokenizer, deltas, fake_pool,
                                           request_run, rpc_error, sample, samples)

COUNTS = ("pdserve:time_to_first_token_seconds_count", "pdserve:inter_token_latency_seconds_count",
          "pdserve:e2e_request_latency_seconds_count", "pdserve:kv_transfer_seconds_count",
          "pdserve:generation_tokens_total", "pdserve:prompt_tokens_total", "pdserve:request_retries_total",
          "pdserve:request_migrations_total")


def outcomes() -> dict[str, float]:
    return {**{r: sample("pdserve:request_success_total", finished_reason=r) for r in ("stop", "length", "abort")},
            **{c: sample("pdserve:request_failures_total", code=c) for c in ("UNAVAILABLE", "RESOURCE_EXHAUSTED")}}


def changed(before: dict[str, float]) -> dict[str, float]:
    return {k: v - before[k] for k, v in outcomes().items() if v != before[k]}


async def consume(run, stop_after: int | None = None) -> list:
    """Read the run's stream as a front would; ``stop_after`` responses, then close it."""
    out = []
    stream = run.responses()
    try:
        async for resp in stream:
            out.append(resp)
            if len(out) == stop_after:
                break
    finally:
        await stream.aclose()
    return out


def test_a_finished_request_counts_its_tokens_batches_and_transfer():
    before, before_outcomes = samples(*COUNTS), outcomes()
    resps = asyncio.run(consume(request_run(fake_pool([FakePrefill()], [FakeDecode()]), max_tokens=4, prompt_len=7)))
    assert sum(len(r.token_ids) for r in resps) == 4
    assert deltas(before) == {
        "pdserve:time_to_first_token_seconds_count": 1, "pdserve:inter_token_latency_seconds_count": 3,
        "pdserve:e2e_request_latency_seconds_count": 1, "pdserve:kv_transfer_seconds_count": 1,
        "pdserve:generation_tokens_total": 4, "pdserve:prompt_tokens_total": 7, "pdserve:request_retries_total": 0,
        "pdserve:request_migrations_total": 0}
    assert changed(before_outcomes) == {"length": 1}


def test_a_caller_that_stops_reading_after_the_last_response_did_not_abort():
    before = outcomes()
    asyncio.run(consume(request_run(fake_pool([FakePrefill()], [FakeDecode()]), max_tokens=3), stop_after=3))
    assert changed(before) == {"length": 1}


def test_a_client_gone_mid_stream_is_an_abort():
    before = outcomes()
    asyncio.run(consume(request_run(fake_pool([FakePrefill()], [FakeDecode()]), max_tokens=8), stop_after=2))
    assert changed(before) == {"abort": 1}


def test_a_cancelled_request_is_an_abort():
    async def cancel_mid_stream():
        started = asyncio.Event()

        async def read():  # as the service does on Abort: the cancel lands while decode runs
            pool = fake_pool([FakePrefill()], [FakeDecode(token_s=0.01)])
            async for _ in request_run(pool, max_tokens=50).responses():
                started.set()

        task = asyncio.create_task(read())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    before = outcomes()
    asyncio.run(cancel_mid_stream())
    assert changed(before) == {"abort": 1}


def test_a_prefill_retry_and_a_migration_are_counted_and_the_request_still_finishes():
    prefill = FakePrefill(errors=[rpc_error(grpc.StatusCode.UNAVAILABLE, "gone")])  # shared: the first pick fails
    decode = FakeDecode(fail_after=1)  # shared: the first stream dies after one decoded token
    before, before_outcomes = samples(*COUNTS), outcomes()
    resps = asyncio.run(consume(request_run(fake_pool([prefill, prefill], [decode, decode]), max_tokens=5)))
    d = deltas(before)
    assert sum(len(r.token_ids) for r in resps) == 5
    assert (d["pdserve:request_retries_total"], d["pdserve:request_migrations_total"]) == (1, 1)
    assert d["pdserve:time_to_first_token_seconds_count"] == 1  # re-prefilled tokens are not first tokens
    assert d["pdserve:kv_transfer_seconds_count"] == 2 and d["pdserve:prompt_tokens_total"] == 7
    assert changed(before_outcomes) == {"length": 1}


def test_a_request_no_worker_can_take_is_a_failure_by_status():
    prefill = FakePrefill(errors=[rpc_error(grpc.StatusCode.UNAVAILABLE, "gone")])
    before = outcomes()
    with pytest.raises(RouteError):
        # The lone prefill worker is marked down: the request waits its admission budget for a
        # replacement that never comes, then fails.
        asyncio.run(consume(request_run(fake_pool([prefill], [FakeDecode()]), admission_wait_s=0.2)))
    assert changed(before) == {"UNAVAILABLE": 1}


def client(role: str, address: str, healthy: bool = True, **stats) -> WorkerClient:
    s = worker_pb2.WorkerStats(role=role, **stats) if stats else None
    return WorkerClient(role, address, channel=None, stub=None, healthy=healthy, stats=s)


def test_pool_loads_sum_healthy_workers_and_keep_empty_pools():
    workers = [
        client("decode", "d0", num_running=3, num_waiting=1, num_blocks_used=30, num_blocks_total=100),
        client("decode", "d1", num_running=1, num_blocks_used=10, num_blocks_total=100),
        client("decode", "d2", healthy=False, num_running=9, num_blocks_used=99, num_blocks_total=100),  # stale
        client("decode", "d3"),  # never answered a poll
    ]
    loads = pool_loads(workers)
    assert loads["decode"] == PoolLoad(running=4, waiting=1, blocks_used=40, blocks_total=200, replicas=2)
    assert loads["decode"].kv_usage == pytest.approx(0.2)
    assert loads["prefill"] == PoolLoad() and loads["prefill"].kv_usage == 0.0


def test_published_gauges_follow_the_pool_and_desired_equals_replicas():
    pool = WorkerPool()
    for w in (client("prefill", "p0", num_waiting=5, num_blocks_used=1, num_blocks_total=4),
              client("prefill", "p1", num_waiting=2, num_blocks_used=1, num_blocks_total=4)):
        pool.workers[w.address] = w
    pool.publish_metrics()
    got = {name: sample(f"pdserve:{name}", pool="prefill") for name in (
        "num_requests_waiting", "kv_cache_usage_perc", "pool_replicas", "autoscaler_desired_replicas")}
    assert got == {"num_requests_waiting": 7, "kv_cache_usage_perc": 0.25, "pool_replicas": 2,
                   "autoscaler_desired_replicas": 2}
    assert sample("pdserve:pool_replicas", pool="decode") == 0


def test_metrics_targets_list_every_worker_that_reported_an_address():
    pool = WorkerPool()
    for w in (client("prefill", "p0:1", worker_id="prefill-0", metrics_address="127.0.0.1:9101"),
              client("decode", "d0:1", healthy=False, worker_id="decode-0", metrics_address="127.0.0.1:9102"),
              client("decode", "d1:1")):  # no stats yet: nothing to scrape
        pool.workers[w.address] = w
    assert pool.metrics_targets() == [
        {"targets": ["127.0.0.1:9101"], "labels": {"pool": "prefill", "worker": "prefill-0"}},
        {"targets": ["127.0.0.1:9102"], "labels": {"pool": "decode", "worker": "decode-0"}},  # down: Prometheus sees it
    ]


class _SlowTokenizer(LetterTokenizer):
    """Tokenizing takes 0.3 s, as a long prompt or chat template can."""

    def encode(self, text: str) -> list[int]:
        time.sleep(0.3)
        return [3 + ord(c) % 26 for c in text]


def test_latencies_count_from_arrival_so_tokenizing_is_inside_ttft():
    model = ModelInfo("fake", config=SimpleNamespace(vocab_size=1000), max_model_len=4096, block_size=16,
                      tokenizer=_SlowTokenizer())
    service = GenerationService(model, fake_pool([FakePrefill()], [FakeDecode()]), RouterLimits())
    request = pdserve_pb2.GenerateRequest(text="hello", sampling=pdserve_pb2.SamplingParams(max_tokens=2))
    names = ("pdserve:time_to_first_token_seconds_sum", "pdserve:e2e_request_latency_seconds_sum")
    before = samples(*names)

    async def drain():
        return [r async for r in service.run(request)]

    assert sum(len(r.token_ids) for r in asyncio.run(drain())) == 2
    grown = deltas(before)
    assert grown["pdserve:time_to_first_token_seconds_sum"] >= 0.3
    assert grown["pdserve:e2e_request_latency_seconds_sum"] >= 0.3
