"""A decode worker's settings, built once at its process entry (pdserve.cluster) and passed in."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.config import EngineConfig
from pdserve.kv_transfer import DEFAULT_BACKEND
from pdserve.kv_transfer.checksum import VERIFY_BY_DEFAULT
from pdserve.wire.tls import TlsConfig


@dataclass(frozen=True)
class DecodeWorkerConfig:
    worker_id: str = "decode-0"
    model_name: str = "smollm2"  # the served name (the first), the workers' metrics label model_name
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str | None = "127.0.0.1"  # internal plane bind address; None: the node's IP (wire.address)
    advertise_host: str | None = None  # what peers dial; None: from host (wire.address.resolve)
    tls: TlsConfig | None = None  # mTLS on the internal plane (wire.tls)
    insecure_internal: bool = False  # allow binding beyond loopback without tls (wire.internal_plane)
    port: int = 0
    metrics_port: int = 0  # Prometheus /metrics on host; 0: any free port (Stats tells which)
    kv_transfer_backend: str = DEFAULT_BACKEND
    # A read not done this long after it started fails (and the router re-prefills). No default
    # here: the process entry passes the ``transfer_timeout_seconds`` setting (cluster.settings).
    transfer_timeout_s: float = field(kw_only=True)
    verify_kv: bool = VERIFY_BY_DEFAULT  # check every block read against the holder's checksum (kv_transfer.checksum)
    # Tensor-parallel size of the prefill pool, which reads this one's held prefixes (prefix_hold):
    # blocks are checksummed in groups of heads for its ranks (as PrefillWorkerConfig.reader_tp).
    reader_tp: int = 1
    inject_transfer_delay_s: float = 0.0  # fault-injection hook for tests: slows every read
    max_requests: int = 1024  # requests held at once (waiting for KV, queued or running); past it RESOURCE_EXHAUSTED
    max_receive_bytes: int = 4 << 20  # largest gRPC request its server accepts; larger: RESOURCE_EXHAUSTED
    cpus: tuple[int, ...] = ()  # cores this worker's threads run on (sched_setaffinity); empty: any
    borrow_cpus: tuple[int, ...] = ()  # other workers' cores its kernels may use while idle (shell.worker)
    # While a prefill worker borrows its cores, start a step at most this often (shell.core_lending); 0: never pace.
    lend_tpot_s: float = 0.0
    step_trace_dir: str | None = None  # append each engine step to <dir>/<worker_id>.steps.jsonl (engine.core.step_trace)
    otlp_traces_endpoint: str | None = None  # export request spans there (wire.tracing); None: off
    # A prefix held for a prefill worker's read (prefix_hold) is freed this long after the hold
    # at the latest. No default here: the process entry passes the ``lease_seconds`` setting.
    lease_seconds: float = field(kw_only=True)
    # Conversations keep their KV (the ``decode_kv_reuse`` setting): publish this worker's
    # prefix-cache events to routers, as a prefill worker does, so a conversation's next turn
    # comes back where its prompt and answer are cached; and read a remote-prefilled prompt's
    # KV only past what this worker's own prefix cache holds. Off: neither (as before issue 44).
    decode_kv_reuse: bool = True
    cache_event_log_size: int = 16384  # events kept for routers' polls (PrefillWorkerConfig's)
