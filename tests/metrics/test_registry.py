"""What a scraper reads: names kept as ``pdserve:...``, the documented list complete, and a
worker's own /metrics endpoint reading its stats at scrape time."""

import re
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.protos import worker_pb2
from pdserve.wire import metrics, worker_metrics


def exported_families() -> dict[str, str]:
    """Family name -> type, as the exposition format writes the names."""
    body, _ = metrics.render()
    return {f.name: f.type for f in text_string_to_metric_families(body.decode())}


def test_render_keeps_the_colon_names_in_the_classic_text_format():
    body, content_type = metrics.render()
    text = body.decode()
    assert content_type.startswith("text/plain; version=0.0.4")
    assert "# TYPE pdserve:time_to_first_token_seconds histogram" in text
    assert "# TYPE pdserve:kv_transfer_bytes_total counter" in text
    assert "_created" not in text  # disabled: they would double the series


def test_every_family_is_in_the_module_docstring_and_every_documented_name_exists():
    documented = set(re.findall(r"``(pdserve:[a-z0-9_:]+)", metrics.__doc__))
    exported = {name + ("_total" if kind == "counter" else "") for name, kind in exported_families().items()}
    assert documented == exported


class FakeWorker:
    def __init__(self):
        self.stats = worker_pb2.WorkerStats(
            num_running=2, num_waiting=1, num_blocks_used=25, num_blocks_total=100, kv_transfer_bytes=4096,
            kv_transfers=2, prefix_cache_queries=48, prefix_cache_hits=16, leases_expired=1, kv_quarantined_blocks=3)


@pytest.fixture
def endpoint():
    worker = FakeWorker()
    ep = worker_metrics.serve_worker("127.0.0.1", 0, worker_metrics.WorkerSource("decode", "decode-7", lambda: worker.stats, 16, "tiny"))
    yield ep, worker
    ep.stop()


def scrape(address: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_a_worker_endpoint_reads_its_stats_at_each_scrape(endpoint):
    ep, worker = endpoint
    labels = (("model_name", "tiny"), ("pool", "decode"), ("worker", "decode-7"))
    got = scrape(ep.address)
    assert got[("pdserve:worker_num_requests_running", labels)] == 2
    assert got[("pdserve:worker_kv_cache_usage_perc", labels)] == 0.25
    assert got[("pdserve:kv_transfer_bytes_total", labels)] == 4096
    # Prefix-cache counters are in tokens, as vLLM's: blocks x block size.
    assert got[("pdserve:prefix_cache_queries_total", labels)] == 48
    assert got[("pdserve:prefix_cache_hits_total", labels)] == 16
    assert got[("pdserve:kv_quarantined_blocks", labels)] == 3
    worker.stats.kv_transfer_bytes = 8192
    assert scrape(ep.address)[("pdserve:kv_transfer_bytes_total", labels)] == 8192


def test_a_worker_endpoint_serves_no_router_family(endpoint):
    ep, _ = endpoint
    names = {name for name, _ in scrape(ep.address)}
    assert names and all(not n.startswith("pdserve:time_to_first_token") for n in names)
    assert "pdserve:pool_replicas" not in names


def test_a_stopped_worker_is_no_longer_exported():
    ep = worker_metrics.serve_worker("127.0.0.1", 0, worker_metrics.WorkerSource("prefill", "prefill-9", worker_pb2.WorkerStats, 16))
    assert metrics.REGISTRY.get_sample_value("pdserve:kv_transfers_total", {"pool": "prefill", "worker": "prefill-9", "model_name": "smollm2"}) == 0
    ep.stop()
    assert metrics.REGISTRY.get_sample_value("pdserve:kv_transfers_total", {"pool": "prefill", "worker": "prefill-9", "model_name": "smollm2"}) is None


def test_preemptions_and_per_read_transfer_histograms_with_their_backend():
    worker = FakeWorker()
    worker.stats.num_preemptions = 3
    ep = worker_metrics.serve_worker("127.0.0.1", 0, worker_metrics.WorkerSource("decode", "decode-8", lambda: worker.stats, 16, "tiny"))
    worker_metrics.kv_transfer_done("decode", "decode-8", "tcp", seconds=0.003, nbytes=5 << 20, descriptors=20, model_name="tiny")
    worker_metrics.kv_transfer_done("decode", "decode-8", "tcp", seconds=0.2, nbytes=1 << 20, descriptors=4, model_name="tiny")
    got = scrape(ep.address)
    assert got[("pdserve:num_preemptions_total", (("model_name", "tiny"), ("pool", "decode"), ("worker", "decode-8")))] == 3
    labels = (("backend", "tcp"), ("model_name", "tiny"), ("pool", "decode"), ("worker", "decode-8"))
    assert got[("pdserve:worker_kv_transfer_seconds_count", labels)] == 2
    assert got[("pdserve:worker_kv_transfer_seconds_sum", labels)] == pytest.approx(0.203)
    assert got[("pdserve:worker_kv_transfer_bytes_sum", labels)] == 6 << 20
    assert got[("pdserve:worker_kv_transfer_descriptors_sum", labels)] == 24
    assert got[("pdserve:worker_kv_transfer_descriptors_bucket", tuple(sorted(labels + (("le", "4.0"),))))] == 1
    ep.stop()  # a stopped worker's reads are no longer exported
    assert metrics.REGISTRY.get_sample_value("pdserve:worker_kv_transfer_seconds_count", dict(labels)) is None


def test_a_speculating_worker_exports_vllms_spec_decode_counters_and_others_none():
    """Each position up to the worker's k has its series from the start (0 until a guess there
    is kept); a worker without ``--speculative-config`` exports no spec_decode series."""
    worker = FakeWorker()
    worker.stats.spec_num_speculative_tokens = 3
    worker.stats.spec_num_drafts, worker.stats.spec_num_draft_tokens, worker.stats.spec_num_accepted_tokens = 10, 30, 12
    worker.stats.spec_accepted_per_pos.extend([7, 5])
    ep = worker_metrics.serve_worker("127.0.0.1", 0, worker_metrics.WorkerSource("decode", "decode-5", lambda: worker.stats, 16, "tiny"))
    plain = worker_metrics.serve_worker("127.0.0.1", 0, worker_metrics.WorkerSource("prefill", "prefill-5", worker_pb2.WorkerStats, 16))
    try:
        got = scrape(ep.address)
    finally:
        ep.stop()
        plain.stop()
    labels = (("model_name", "tiny"), ("pool", "decode"), ("worker", "decode-5"))
    assert [got[(f"pdserve:spec_decode_num_{name}_total", labels)] for name in ("drafts", "draft_tokens", "accepted_tokens")] == [10, 30, 12]
    per_pos = {dict(key)["position"]: value for (name, key), value in got.items()
               if name == "pdserve:spec_decode_num_accepted_tokens_per_pos_total" and dict(key)["worker"] == "decode-5"}
    assert per_pos == {"0": 7, "1": 5, "2": 0}
    assert not [key for key in got if key[0].startswith("pdserve:spec_decode") and dict(key[1])["worker"] == "prefill-5"]


def test_a_worker_endpoint_keeps_the_colon_names_whatever_the_scraper_accepts(endpoint):
    """Prometheus asks for OpenMetrics first; prometheus_client's own server then escapes the
    colons (pdserve_worker_...), and no dashboard query matched a worker (found by
    tests/metrics/test_prometheus_live.py)."""
    ep, _ = endpoint
    accept = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
    req = urllib.request.Request(f"http://{ep.address}/metrics", headers={"Accept": accept})
    with urllib.request.urlopen(req, timeout=5) as resp:
        content_type, text = resp.headers["Content-Type"], resp.read().decode()
    assert content_type.startswith("text/plain; version=0.0.4")
    assert 'pdserve:worker_num_requests_running{model_name="tiny",pool="decode",worker="decode-7"} 2.0' in text
    assert "pdserve_" not in text


def test_a_worker_with_a_kv_tier_exports_its_tier_series_and_others_none():
    """The tier's bytes and bound, this worker's blocks moved each way, its tier hits and corrupt
    blocks, labelled with the tier's id; a worker without ``--kv-offload-bytes`` exports none."""
    worker = FakeWorker()
    worker.stats.kv_tier_id = "host:/dev/shm/pdserve-kv-tier/ns"
    worker.stats.kv_tier_bytes_used, worker.stats.kv_tier_capacity_bytes = 3 << 20, 8 << 30
    worker.stats.kv_tier_blocks_offloaded, worker.stats.kv_tier_blocks_loaded = 40, 12
    worker.stats.prefix_cache_tier_hits, worker.stats.kv_tier_corrupt_blocks = 192, 1
    ep = worker_metrics.serve_worker("127.0.0.1", 0, worker_metrics.WorkerSource("prefill", "prefill-8", lambda: worker.stats, 16, "tiny"))
    plain = worker_metrics.serve_worker("127.0.0.1", 0, worker_metrics.WorkerSource("decode", "decode-8", worker_pb2.WorkerStats, 16))
    try:
        got = scrape(ep.address)
    finally:
        ep.stop()
        plain.stop()
    labels = (("model_name", "tiny"), ("pool", "prefill"), ("tier", "host:/dev/shm/pdserve-kv-tier/ns"), ("worker", "prefill-8"))
    names = ("kv_tier_bytes", "kv_tier_capacity_bytes", "kv_tier_blocks_offloaded_total", "kv_tier_blocks_loaded_total",
             "prefix_cache_tier_hits_total", "kv_tier_corrupt_blocks_total")
    assert [got[(f"pdserve:{name}", labels)] for name in names] == [3 << 20, 8 << 30, 40, 12, 192, 1]
    assert not [key for key in got if "tier" in key[0] and dict(key[1])["worker"] == "decode-8"]
