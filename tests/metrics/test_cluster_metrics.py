"""Metrics of a real cluster (Ray actors, gRPC, NIXL, the default model), read the way
Prometheus reads them: the router's /metrics and /metrics/targets on its HTTP port, and each
worker's /metrics at the address the router lists. The numbers must match what the
requests did, exactly where they can."""

import json
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.protos import pdserve_pb2, pdserve_pb2_grpc
from tests.helpers.kv_layout import moved_bytes
from tests.serving.conftest import all_stats, start_cluster

pytestmark = pytest.mark.slow

# Several KV blocks long, so that asking it twice hits the prefix cache.
QUESTION = ("Write one sentence about the moon, the tides it raises on the sea, the sailors who watch them, "
            "and the fishermen who wait for the water to come back to the harbour at dawn.")
PROMPTS = (QUESTION, QUESTION, "Name three rivers.")
MAX_TOKENS = 6


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.read().decode()


def scrape(address: str) -> dict[str, float]:
    """Samples keyed as PromQL writes them: ``name`` or ``name{label="value",...}``. The
    router's and the workers' families carry the served model's name, checked here and left out of the key."""
    out = {}
    for family in text_string_to_metric_families(get(f"http://{address}/metrics")):
        for s in family.samples:
            assert s.labels.pop("model_name", "smollm2") == "smollm2", s
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def delta(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return after[key] - before.get(key, 0.0)


@pytest.fixture(scope="module")
def traffic():
    """A 1+1 cluster after three requests sent through the router's gRPC API: scrapes of
    every endpoint before and after, each worker's stats, and the requests' usage."""
    cluster = start_cluster(num_prefill=1, num_decode=1, delay_s=0.0)
    try:
        stats = {s.role: s for s in all_stats(cluster)}
        endpoints = {"router": cluster.http_address, **{role: s.metrics_address for role, s in stats.items()}}
        before = {name: scrape(address) for name, address in endpoints.items()}
        with grpc.insecure_channel(cluster.address) as channel:
            stub = pdserve_pb2_grpc.GenerationStub(channel)
            usage = [list(stub.Generate(pdserve_pb2.GenerateRequest(text=text, sampling=pdserve_pb2.SamplingParams(
                max_tokens=MAX_TOKENS, ignore_eos=True)), timeout=120))[-1].usage for text in PROMPTS]
        after = {name: scrape(address) for name, address in endpoints.items()}
        targets = json.loads(get(f"http://{cluster.http_address}/metrics/targets"))
        mixed = scrape(cluster.http_address) if _mixed_load(cluster) else {}
        yield stats, usage, before, after, targets, mixed
    finally:
        cluster.stop()


def _mixed_load(cluster) -> bool:
    """Two more requests over the OpenAI HTTP API (one ends at EOS, one at its length) and one
    aborted through gRPC mid-stream."""
    for body in ({"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 200, "temperature": 0},
                 {"messages": [{"role": "user", "content": "Count to ten."}], "max_tokens": 3, "temperature": 0}):
        req = urllib.request.Request(f"http://{cluster.http_address}/v1/chat/completions",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            json.loads(resp.read())
    with grpc.insecure_channel(cluster.address) as channel:
        stub = pdserve_pb2_grpc.GenerationStub(channel)
        stream = stub.Generate(pdserve_pb2.GenerateRequest(text="Tell a long story.", sampling=pdserve_pb2.SamplingParams(
            max_tokens=300, ignore_eos=True)), timeout=120)
        first = next(stream)
        stub.Abort(pdserve_pb2.AbortRequest(request_id=first.request_id))
        list(stream)
    return True


def test_outcomes_by_finish_reason_after_a_mixed_load(traffic):
    _, _, _, after, _, mixed = traffic
    a = after["router"]
    for reason in ("stop", "length", "abort"):
        key = f'pdserve:request_success_total{{finished_reason="{reason}"}}'
        assert mixed[key] - a.get(key, 0.0) == 1, reason
    assert mixed["pdserve:time_to_first_token_seconds_count"] - a["pdserve:time_to_first_token_seconds_count"] == 3


def test_the_router_lists_each_workers_metrics_endpoint(traffic):
    stats, _, _, _, targets, _ = traffic
    assert sorted(targets, key=lambda t: t["labels"]["pool"]) == [
        {"targets": [stats["decode"].metrics_address], "labels": {"pool": "decode", "worker": "decode-0"}},
        {"targets": [stats["prefill"].metrics_address], "labels": {"pool": "prefill", "worker": "prefill-0"}}]


def test_decode_worker_counts_every_kv_byte_it_pulled(traffic):
    stats, usage, before, after, _, _ = traffic
    b, a = before["decode"], after["decode"]
    labels = '{pool="decode",worker="decode-0"}'
    # The question asked twice: its second read moves only what the decode worker's own prefix
    # cache lacked (decode_kv_reuse), which counts the tokens it had.
    reused = delta(b, a, "pdserve:prefix_cache_hits_total" + labels)
    assert reused > 0
    per_token = stats["decode"].kv_bytes_per_token
    assert delta(b, a, "pdserve:kv_transfer_bytes_total" + labels) == sum(
        moved_bytes(u.prompt_tokens, 0, per_token) for u in usage) - int(reused) * per_token
    assert delta(b, a, "pdserve:kv_transfers_total" + labels) == len(PROMPTS)
    assert delta(b, a, "pdserve:kv_transfer_failures_total" + labels) == 0
    # Decode runs no prompt: one forward token per generated token after the first.
    assert delta(b, a, "pdserve:forward_tokens_total" + labels) == sum(u.completion_tokens - 1 for u in usage)
    assert 0 <= a["pdserve:worker_kv_cache_usage_perc" + labels] <= 1


def test_prefill_worker_counts_prefix_cache_hits_in_tokens(traffic):
    _, usage, before, after, _, _ = traffic
    b, a = before["prefill"], after["prefill"]
    labels = '{pool="prefill",worker="prefill-0"}'
    cached = sum(u.cached_prompt_tokens for u in usage)
    assert cached > 0
    assert delta(b, a, "pdserve:prefix_cache_hits_total" + labels) == cached
    assert delta(b, a, "pdserve:prefix_cache_queries_total" + labels) >= cached
    assert delta(b, a, "pdserve:forward_tokens_total" + labels) == sum(u.prompt_tokens for u in usage) - cached


def test_router_records_each_request_and_its_pools(traffic):
    _, usage, before, after, _, _ = traffic
    b, a, n = before["router"], after["router"], len(PROMPTS)
    counts = {name: delta(b, a, name) for name in (
        "pdserve:time_to_first_token_seconds_count", "pdserve:inter_token_latency_seconds_count",
        "pdserve:e2e_request_latency_seconds_count", "pdserve:request_queue_time_seconds_count",
        "pdserve:request_prefill_time_seconds_count", "pdserve:request_decode_time_seconds_count",
        "pdserve:kv_transfer_seconds_count", "pdserve:generation_tokens_total", "pdserve:prompt_tokens_total",
        "pdserve:request_retries_total", "pdserve:request_migrations_total")}
    assert counts == {
        "pdserve:time_to_first_token_seconds_count": n,
        "pdserve:inter_token_latency_seconds_count": n * (MAX_TOKENS - 1),  # one token per decode response
        "pdserve:e2e_request_latency_seconds_count": n, "pdserve:request_queue_time_seconds_count": n,
        "pdserve:request_prefill_time_seconds_count": n, "pdserve:request_decode_time_seconds_count": n,
        "pdserve:kv_transfer_seconds_count": n, "pdserve:generation_tokens_total": n * MAX_TOKENS,
        "pdserve:prompt_tokens_total": sum(u.prompt_tokens for u in usage),
        "pdserve:request_retries_total": 0, "pdserve:request_migrations_total": 0}
    assert delta(b, a, 'pdserve:request_success_total{finished_reason="length"}') == n
    assert delta(b, a, "pdserve:request_prefill_time_seconds_sum") > 0
    # TTFT includes the prefill; the e2e includes the TTFT.
    assert (delta(b, a, "pdserve:e2e_request_latency_seconds_sum")
            > delta(b, a, "pdserve:time_to_first_token_seconds_sum")
            > delta(b, a, "pdserve:request_prefill_time_seconds_sum"))
    for pool in ("prefill", "decode"):
        assert a[f'pdserve:pool_replicas{{pool="{pool}"}}'] == 1
        assert a[f'pdserve:autoscaler_desired_replicas{{pool="{pool}"}}'] == 1
