"""A prefill worker's settings, built once at its process entry (pdserve.cluster) and passed in."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.config import EngineConfig
from pdserve.kv_transfer import DEFAULT_BACKEND
from pdserve.kv_transfer.checksum import VERIFY_BY_DEFAULT
from pdserve.wire.tls import TlsConfig


@dataclass(frozen=True)
class PrefillWorkerConfig:
    worker_id: str = "prefill-0"
    model_name: str = "smollm2"  # the served name (the first), the workers' metrics label model_name
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str | None = "127.0.0.1"  # internal plane bind address; None: the node's IP (wire.address)
    advertise_host: str | None = None  # what peers dial; None: from host (wire.address.resolve)
    tls: TlsConfig | None = None  # mTLS on the internal plane (wire.tls)
    insecure_internal: bool = False  # allow binding beyond loopback without tls (wire.internal_plane)
    port: int = 0  # 0: any free port
    metrics_port: int = 0  # Prometheus /metrics on host; 0: any free port (Stats tells which)
    # Held KV is freed this long after the first token at the latest. No default here: the
    # process entry passes the ``lease_seconds`` setting (declared once, in cluster.settings).
    lease_seconds: float = field(kw_only=True)
    # A router that has not polled Stats (nor sent a Prefill) for this long is taken for dead:
    # the unclaimed KV held for it is freed then, not at lease expiry (routers poll every 0.2 s).
    owner_timeout_s: float = 10.0
    kv_transfer_backend: str = DEFAULT_BACKEND
    verify_kv: bool = VERIFY_BY_DEFAULT  # checksum each held block once final, for its reader (kv_transfer.checksum)
    # Tensor-parallel size of the workers that read this one's KV (the decode pool's): each
    # block is checksummed in as many groups of heads as a reader rank needs to check its own.
    reader_tp: int = 1
    max_requests: int = 1024  # requests held at once (queued or running); past it RESOURCE_EXHAUSTED
    max_receive_bytes: int = 4 << 20  # largest gRPC request its server accepts; larger: RESOURCE_EXHAUSTED
    cpus: tuple[int, ...] = ()  # cores this worker's threads run on (sched_setaffinity); empty: any
    borrow_cpus: tuple[int, ...] = ()  # other workers' cores its kernels may use while idle (shell.worker)
    step_trace_dir: str | None = None  # append each engine step to <dir>/<worker_id>.steps.jsonl (engine.core.step_trace)
    otlp_traces_endpoint: str | None = None  # export request spans there (wire.tracing); None: off
    # Prefix-cache events kept for routers' polls (shell.cache_events). A router further
    # behind gets a snapshot instead. At ~1,000 prompt tokens/s a CPU worker makes ~60 events a
    # second, so this covers minutes between two 0.2 s polls.
    cache_event_log_size: int = 16384
