"""Metrics of a real cluster (Ray actors, gRPC, NIXL, the default model): each worker's
/metrics, found through its stats, counts exactly what the requests did; the router's
orchestrator, run in this process against the same workers, records the requests and
lists the workers' scrape targets. (The router process's own /metrics is served by the
HTTP front and tested with it.)"""

import asyncio
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from protos import pdserve_pb2, pdserve_pb2_grpc
from router.frontend import prepare
from router.orchestrator import RequestRun, RouterLimits
from router.pool import WorkerPool
from router.server import RouterConfig, load_model_info
from tests.metrics.metrics_helpers import deltas, sample, samples
from tests.serving.conftest import all_stats, start_cluster

pytestmark = pytest.mark.slow

# Several KV blocks long, so that asking it twice hits the prefix cache.
QUESTION = ("Write one sentence about the moon, the tides it raises on the sea, the sailors who watch them, "
            "and the fishermen who wait for the water to come back to the harbour at dawn.")


@pytest.fixture(scope="module")
def cluster():
    c = start_cluster(num_prefill=1, num_decode=1, delay_s=0.0)
    yield c
    c.stop()


def request(text: str, max_tokens: int) -> pdserve_pb2.GenerateRequest:
    return pdserve_pb2.GenerateRequest(text=text, sampling=pdserve_pb2.SamplingParams(
        max_tokens=max_tokens, ignore_eos=True))


def scrape(address: str) -> dict[str, float]:
    """The worker's samples by name (one worker per endpoint, so names are unique)."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_each_worker_exports_what_its_requests_did(cluster):
    stats = {s.role: s for s in all_stats(cluster)}
    prefill, decode = stats["prefill"], stats["decode"]
    assert prefill.metrics_address and decode.metrics_address
    before = {role: scrape(s.metrics_address) for role, s in stats.items()}
    usages = []
    with grpc.insecure_channel(cluster.address) as channel:
        stub = pdserve_pb2_grpc.GenerationStub(channel)
        for text in (QUESTION, QUESTION, "Name three rivers."):  # the repeat hits the prefix cache
            usages.append(list(stub.Generate(request(text, 6), timeout=120))[-1].usage)
    after = {role: scrape(s.metrics_address) for role, s in stats.items()}
    d = {role: {name: after[role][name] - before[role].get(name, 0.0) for name in after[role]} for role in after}

    prompt_tokens = sum(u.prompt_tokens for u in usages)
    cached = sum(u.cached_prompt_tokens for u in usages)
    assert cached > 0
    assert d["decode"]["pdserve:kv_transfer_bytes_total"] == prompt_tokens * decode.kv_bytes_per_token
    assert d["decode"]["pdserve:kv_transfers_total"] == 3
    assert d["decode"]["pdserve:kv_transfer_failures_total"] == 0
    assert d["decode"]["pdserve:forward_tokens_total"] == sum(u.completion_tokens - 1 for u in usages)
    assert d["prefill"]["pdserve:prefix_cache_hits_total"] == cached
    assert d["prefill"]["pdserve:prefix_cache_queries_total"] >= cached
    assert d["prefill"]["pdserve:forward_tokens_total"] == prompt_tokens - cached
    assert 0 <= after["decode"]["pdserve:worker_kv_cache_usage_perc"] <= 1


ROUTER_COUNTS = ("pdserve:time_to_first_token_seconds_count", "pdserve:inter_token_latency_seconds_count",
                 "pdserve:request_queue_time_seconds_count", "pdserve:request_prefill_time_seconds_count",
                 "pdserve:kv_transfer_seconds_count", "pdserve:generation_tokens_total",
                 "pdserve:prompt_tokens_total", "pdserve:request_prefill_time_seconds_sum")


def test_the_orchestrator_records_a_real_request_and_the_pool_finds_the_workers(cluster):
    model = load_model_info(RouterConfig(engine=cluster.config.engine))
    prepared = prepare(request(QUESTION, 5), model)
    before = samples(*ROUTER_COUNTS)
    before_length = sample("pdserve:request_success_total", finished_reason="length")

    async def run() -> tuple[list, list[dict]]:
        pool = WorkerPool()
        for role, addresses in (("prefill", cluster.prefill_addresses), ("decode", cluster.decode_addresses)):
            for address in addresses:
                pool.add(role, address)
        await pool.refresh()
        try:
            resps = [r async for r in RequestRun(prepared, model, pool, RouterLimits()).responses()]
            return resps, pool.metrics_targets()
        finally:
            await pool.close()

    resps, targets = asyncio.run(run())
    d = deltas(before)
    assert sum(len(r.token_ids) for r in resps) == 5
    assert {k: v for k, v in d.items() if not k.endswith("_sum")} == {
        "pdserve:time_to_first_token_seconds_count": 1, "pdserve:inter_token_latency_seconds_count": 4,
        "pdserve:request_queue_time_seconds_count": 1, "pdserve:request_prefill_time_seconds_count": 1,
        "pdserve:kv_transfer_seconds_count": 1, "pdserve:generation_tokens_total": 5,
        "pdserve:prompt_tokens_total": len(prepared.prompt_token_ids)}
    assert d["pdserve:request_prefill_time_seconds_sum"] > 0
    assert sample("pdserve:request_success_total", finished_reason="length") - before_length == 1
    assert sample("pdserve:pool_replicas", pool="prefill") == sample("pdserve:pool_replicas", pool="decode") == 1
    addresses = {s.role: s.metrics_address for s in all_stats(cluster)}
    assert sorted(targets, key=lambda t: t["labels"]["pool"]) == [
        {"targets": [addresses["decode"]], "labels": {"pool": "decode", "worker": "decode-0"}},
        {"targets": [addresses["prefill"]], "labels": {"pool": "prefill", "worker": "prefill-0"}}]
