"""A worker's metrics: the families read from its stats at each scrape, the histograms of its
KV reads, and its own ``/metrics`` endpoint (``serve_worker``).

Every family is listed, with its meaning, in ``pdserve.wire.metrics``, whose router registry lists
these too. A worker's endpoint serves ``WORKER_REGISTRY`` alone: the router's families would
read zero there.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from dataclasses import dataclass
from typing import Callable

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdserve.protos import worker_pb2
from pdserve.wire.address import Endpoint, resolve
from pdserve.wire.internal_plane import check_bind
from pdserve.wire.tls import TlsConfig

# The *_created series double the output and no dashboard reads them (vLLM drops them too).
disable_created_metrics()

# What a worker's own /metrics serves: its families and its transfer histograms, no router family.
WORKER_REGISTRY = CollectorRegistry()
POOL_LABEL = "pool"
MODEL_LABEL = "model_name"

# A NIXL read of a few MiB takes milliseconds; injected delays and timeouts reach seconds.
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0)
# One prompt's KV: SmolLM2-135M holds 30 layers * 2 * 3 heads * 64 * 2 bytes = 23 KiB per token
# in bfloat16, so a 16-token block is ~360 KiB and a long prompt hundreds of MiB.
TRANSFER_BYTES_BUCKETS = tuple(float(4 ** k << 10) for k in range(2, 13))  # 16 KiB .. 16 GiB
DESCRIPTOR_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 4096.0, 16384.0)


@dataclass(frozen=True)
class WorkerSource:
    """A worker whose numbers are exported; ``stats`` is called at each scrape."""

    pool: str
    worker: str
    stats: Callable[[], worker_pb2.WorkerStats]
    block_size: int  # prefix-cache counters are in blocks; vLLM's are in tokens
    model_name: str = "smollm2"  # the served name, as the router's families carry it


def _usage(used: int, total: int) -> float:
    return used / total if total else 0.0


# (family class, name, help, value from the worker's stats and block size)
_WORKER_FAMILIES = (
    (GaugeMetricFamily, "pdserve:worker_num_requests_running", "Requests running (KV transfers included).",
     lambda s, bs: s.num_running),
    (GaugeMetricFamily, "pdserve:worker_num_requests_waiting", "Requests waiting for a prefill slot.",
     lambda s, bs: s.num_waiting),
    (GaugeMetricFamily, "pdserve:worker_num_waiting_prompt_tokens", "Prompt tokens queued, not yet computed.",
     lambda s, bs: s.num_waiting_tokens),
    (GaugeMetricFamily, "pdserve:worker_kv_cache_usage_perc", "Fraction of KV blocks in use (0..1).",
     lambda s, bs: _usage(s.num_blocks_used, s.num_blocks_total)),
    (GaugeMetricFamily, "pdserve:kv_quarantined_blocks",
     "KV blocks kept from reuse until a stopped read into them is over (a read that never ends keeps them).",
     lambda s, bs: s.kv_quarantined_blocks),
    (GaugeMetricFamily, "pdserve:worker_num_held_leases", "Prompts whose KV is held for a decode worker.",
     lambda s, bs: s.num_held_leases),
    (CounterMetricFamily, "pdserve:kv_transfer_bytes_total",
     "KV bytes read from another worker (a decode worker's from prefill workers, a prefill worker's prefixes from "
     "decode workers).", lambda s, bs: s.kv_transfer_bytes),
    (CounterMetricFamily, "pdserve:kv_transfers_total", "KV reads completed.", lambda s, bs: s.kv_transfers),
    (CounterMetricFamily, "pdserve:kv_transfer_failures_total", "KV reads failed.",
     lambda s, bs: s.kv_transfer_failures),
    (CounterMetricFamily, "pdserve:kv_verify_failures_total",
     "KV reads whose bytes did not match the holder's checksums (counted in the failures too).",
     lambda s, bs: s.kv_verify_failures),
    (CounterMetricFamily, "pdserve:kv_unverified_refused_total",
     "KV refused unread because its holder sent no checksums and this worker verifies (prefilled again).",
     lambda s, bs: s.kv_unverified_refused),
    (CounterMetricFamily, "pdserve:kv_leases_expired_total", "Held KV freed because no one pulled it in time.",
     lambda s, bs: s.leases_expired),
    (CounterMetricFamily, "pdserve:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
     lambda s, bs: s.prefix_cache_queries),
    (CounterMetricFamily, "pdserve:prefix_cache_hits_total", "Prompt tokens found in the prefix cache.",
     lambda s, bs: s.prefix_cache_hits),
    (CounterMetricFamily, "pdserve:forward_tokens_total", "Tokens run through the model.",
     lambda s, bs: s.num_forward_tokens),
    (CounterMetricFamily, "pdserve:num_preemptions_total", "Sequences whose KV was freed to make room.",
     lambda s, bs: s.num_preemptions),
    (CounterMetricFamily, "pdserve:prefix_read_tokens_total",
     "Prompt tokens whose KV a prefill worker read from a decode worker instead of computing (the reversed pull).",
     lambda s, bs: s.prefix_tokens_read),
    (CounterMetricFamily, "pdserve:prefix_reads_refused_total",
     "Prefixes a decode worker held that the prefill worker did not read (computed whole instead).",
     lambda s, bs: s.prefix_reads_refused),
)

# Speculative decoding, as vLLM names its counters (``vllm:spec_decode_*``); only for a worker
# that speculates (``spec_num_speculative_tokens`` above 0). Acceptance rate and mean accepted
# length are PromQL over them (docs/speculative.md#serving-it).
_SPEC_FAMILIES = (
    ("pdserve:spec_decode_num_drafts_total", "Proposals of speculated tokens the target verified.",
     lambda s: s.spec_num_drafts),
    ("pdserve:spec_decode_num_draft_tokens_total", "Tokens proposed in them.", lambda s: s.spec_num_draft_tokens),
    ("pdserve:spec_decode_num_accepted_tokens_total", "Of those, tokens the target kept.",
     lambda s: s.spec_num_accepted_tokens),
)
SPEC_PER_POSITION = ("pdserve:spec_decode_num_accepted_tokens_per_pos_total",
                     "Proposals whose token at this position (0: the first speculated) the target kept.")
_LABELS = [POOL_LABEL, "worker", MODEL_LABEL]

# The KV tier below the prefix cache (--kv-offload-bytes); only for a worker that has one
# (``kv_tier_id`` set). Bytes and capacity are the tier's, shared by the workers of a host that
# share its directory (label ``tier``: its id), so ``max by (tier)`` reads one tier once.
_TIER_FAMILIES = (
    (GaugeMetricFamily, "pdserve:kv_tier_bytes", "Bytes the KV tier holds now (every worker's blocks).",
     lambda s: s.kv_tier_bytes_used),
    (GaugeMetricFamily, "pdserve:kv_tier_capacity_bytes", "The KV tier's bound (--kv-offload-bytes).",
     lambda s: s.kv_tier_capacity_bytes),
    (CounterMetricFamily, "pdserve:kv_tier_blocks_offloaded_total",
     "Prefix blocks this worker moved down into the KV tier as its KV memory evicted them.",
     lambda s: s.kv_tier_blocks_offloaded),
    (CounterMetricFamily, "pdserve:kv_tier_blocks_loaded_total",
     "Blocks this worker brought back from the KV tier, verified, for a prompt that matched them.",
     lambda s: s.kv_tier_blocks_loaded),
    (CounterMetricFamily, "pdserve:prefix_cache_tier_hits_total",
     "Of the prefix cache's hits, the prompt tokens found in the KV tier.", lambda s: s.prefix_cache_tier_hits),
    (CounterMetricFamily, "pdserve:kv_tier_corrupt_blocks_total",
     "Blocks read back from the KV tier whose checksum or tokens did not match (deleted; the prompt computed).",
     lambda s: s.kv_tier_corrupt_blocks),
)
_TIER_LABELS = [*_LABELS, "tier"]


def _tier_families() -> list:
    return [cls(name, doc, labels=_TIER_LABELS) for cls, name, doc, _ in _TIER_FAMILIES]


def _spec_families() -> list:
    return [CounterMetricFamily(name, doc, labels=_LABELS) for name, doc, _ in _SPEC_FAMILIES] + [
        CounterMetricFamily(*SPEC_PER_POSITION, labels=[*_LABELS, "position"])]


def _add_spec(families: list, labels: list[str], stats: worker_pb2.WorkerStats) -> None:
    """The worker's speculation counters into ``families`` (``_spec_families``): each position up
    to its ``k`` is a series from the start, at 0 until a guess there is kept."""
    for family, (_, _, value) in zip(families, _SPEC_FAMILIES):
        family.add_metric(labels, value(stats))
    accepted = list(stats.spec_accepted_per_pos)
    for pos in range(max(stats.spec_num_speculative_tokens, len(accepted))):
        families[-1].add_metric([*labels, str(pos)], accepted[pos] if pos < len(accepted) else 0)


class WorkerCollector:
    """The worker families, read from every registered worker of this process at scrape time.

    Reading at scrape time keeps the engine's hot path free of metric updates; the reads
    race with the engine thread the way ``pdserve.shell.stats`` explains.
    """

    def __init__(self) -> None:
        self._sources: dict[str, WorkerSource] = {}
        self._lock = threading.Lock()

    def add(self, source: WorkerSource) -> None:
        with self._lock:
            self._sources[source.worker] = source

    def remove(self, worker: str) -> None:
        with self._lock:
            self._sources.pop(worker, None)

    def describe(self) -> list:
        return ([cls(name, doc, labels=_LABELS) for cls, name, doc, _ in _WORKER_FAMILIES] + _spec_families()
                + _tier_families())

    def collect(self) -> list:
        families = [cls(name, doc, labels=_LABELS) for cls, name, doc, _ in _WORKER_FAMILIES]
        spec, tier = _spec_families(), _tier_families()
        with self._lock:
            sources = list(self._sources.values())
        for src in sources:
            stats = src.stats()
            labels = [stats.role or src.pool, src.worker, src.model_name]  # an elastic worker's pool is its role now
            for family, (_, _, _, value) in zip(families, _WORKER_FAMILIES):
                family.add_metric(labels, value(stats, src.block_size))
            if stats.spec_num_speculative_tokens:
                _add_spec(spec, labels, stats)
            if stats.kv_tier_id:
                for family, (_, _, _, value) in zip(tier, _TIER_FAMILIES):
                    family.add_metric([*labels, stats.kv_tier_id], value(stats))
        return families + spec + tier


WORKERS = WorkerCollector()
WORKER_REGISTRY.register(WORKERS)

# ---- decode workers: one observation per KV read --------------------------------------------
_TRANSFER_LABELS = [POOL_LABEL, "worker", "backend", MODEL_LABEL]
TRANSFER_SECONDS = Histogram("pdserve:worker_kv_transfer_seconds", "One KV read, start to completion.",
                             _TRANSFER_LABELS, buckets=TRANSFER_BUCKETS, registry=WORKER_REGISTRY)
TRANSFER_BYTES = Histogram("pdserve:worker_kv_transfer_bytes", "Bytes one KV read moved.", _TRANSFER_LABELS,
                           buckets=TRANSFER_BYTES_BUCKETS, registry=WORKER_REGISTRY)
TRANSFER_DESCRIPTORS = Histogram("pdserve:worker_kv_transfer_descriptors", "Descriptors one KV read posted.",
                                 _TRANSFER_LABELS, buckets=DESCRIPTOR_BUCKETS, registry=WORKER_REGISTRY)
TRANSFER_FAMILIES = (TRANSFER_SECONDS, TRANSFER_BYTES, TRANSFER_DESCRIPTORS)
_transfer_children: set[tuple[str, str, str, str]] = set()  # label values observed, to remove at stop
_transfer_lock = threading.Lock()


def kv_transfer_done(pool: str, worker: str, backend: str, seconds: float, nbytes: int, descriptors: int,
                     model_name: str = "smollm2") -> None:
    """A decode worker's KV read completed (called from its engine thread)."""
    labels = (pool, worker, backend, model_name)
    with _transfer_lock:
        _transfer_children.add(labels)
    TRANSFER_SECONDS.labels(*labels).observe(seconds)
    TRANSFER_BYTES.labels(*labels).observe(nbytes)
    TRANSFER_DESCRIPTORS.labels(*labels).observe(descriptors)


def _forget_transfers(worker: str) -> None:
    with _transfer_lock:
        gone = {labels for labels in _transfer_children if labels[1] == worker}
        _transfer_children.difference_update(gone)
    for labels in gone:
        for family in TRANSFER_FAMILIES:
            family.remove(*labels)


@dataclass
class MetricsEndpoint:
    """A worker's running ``/metrics`` HTTP server."""

    address: str  # host:port to scrape
    _server: object
    _worker: str

    def stop(self) -> None:
        WORKERS.remove(self._worker)
        _forget_transfers(self._worker)
        self._server.shutdown()
        self._server.server_close()


# A scrape is one small GET: a connection that sends its request slower than this, or reads
# the answer slower, is dropped; and only this many connections are served at once (one thread
# each), so that a peer that opens many and sends nothing holds neither threads nor sockets.
METRICS_TIMEOUT_S = 10.0
MAX_METRICS_CONNECTIONS = 16


def serve_worker(host: str | Endpoint | None, port: int, source: WorkerSource, *, tls: TlsConfig | None = None,
                 insecure_internal: bool = False, timeout_s: float = METRICS_TIMEOUT_S) -> MetricsEndpoint:
    """Export ``source`` and serve this process's worker families on ``host:port`` (0: any;
    ``host`` None: the node's IP). The address it reports is the advertised one
    (``pdserve.wire.address``), never a wildcard.

    The endpoint is on the internal plane: its bind address passes ``check_bind`` as every
    other internal server's does (``tls`` and ``insecure_internal`` are the worker's). Each
    connection has ``timeout_s`` for every read and write, and at most
    ``MAX_METRICS_CONNECTIONS`` are served at once; more are closed unanswered.

    The endpoint serves only the worker families (``WORKER_REGISTRY``): the router's would
    read zero here.
    """
    endpoint = host if isinstance(host, Endpoint) else resolve(host)
    check_bind(endpoint.bind_host, tls, insecure_internal, f"{source.worker}'s /metrics")
    WORKERS.add(source)
    handler = type("_Handler", (_WorkerMetricsHandler,), {"timeout": timeout_s})
    try:
        server = _BoundedHTTPServer((endpoint.bind_host, port), handler)
    except OSError:
        WORKERS.remove(source.worker)
        raise
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name=f"metrics-{source.worker}", daemon=True).start()
    return MetricsEndpoint(endpoint.advertise(server.server_address[1]), server, source.worker)


class _BoundedHTTPServer(ThreadingHTTPServer):
    """A threading HTTP server that serves at most ``MAX_METRICS_CONNECTIONS`` connections at
    once and closes the rest as they arrive."""

    def __init__(self, *args, **kwargs):
        self._slots = threading.BoundedSemaphore(MAX_METRICS_CONNECTIONS)
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class _WorkerMetricsHandler(BaseHTTPRequestHandler):
    """``GET /metrics``: the worker registry, always in text format 0.0.4 as the router's
    ``render``. prometheus_client's own server answers Prometheus' OpenMetrics Accept header
    with underscore-escaped names (``pdserve_worker_...``), which no dashboard query names."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path.split("?")[0] not in ("/", "/metrics"):
            self.send_error(404)
            return
        body = generate_latest(WORKER_REGISTRY)
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_PLAIN_0_0_4)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:  # a scrape a second is not worth a log line
        pass
