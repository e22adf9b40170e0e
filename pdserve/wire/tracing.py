"""OpenTelemetry traces of requests across the processes (``--otlp-traces-endpoint``).

Each process calls ``configure`` once at start with the endpoint (None: off). While it is off,
nothing of OpenTelemetry is imported, ``enabled()`` is False, and every helper here returns
at its first line without making an object: callers on a request's path either hold
``None`` where a span would be, or check ``enabled()`` first. On, the process exports its
spans over OTLP/gRPC in batches, as ``service.name`` ``pdserve-<role>``.

Spans are parented explicitly (``parent=`` a span, or the context ``extract`` read from a
peer's metadata), never through the ambient context: a request's work interleaves with others'
on one event loop, in async generators that a context variable would not follow.

W3C trace context (``traceparent``, ``tracestate``) rides in gRPC metadata (``inject``);
span times may be given as ``time.monotonic()`` seconds (``wall_ns`` converts them), so that
a worker records its queue and chunk spans from timestamps it keeps anyway, after the fact,
instead of from the engine thread's loop.

Attribute names: the GenAI ones vLLM uses (``gen_ai.*``), the OpenTelemetry RPC conventions
for calls, and ``pdserve.*`` for what has no convention (docs/operations.md lists them).
"""

from __future__ import annotations

import time
from typing import Any, Iterable, Mapping

# GenAI request attributes, as vLLM names them (vllm/tracing.py).
REQUEST_ID = "gen_ai.request.id"
RESPONSE_MODEL = "gen_ai.response.model"
MAX_TOKENS = "gen_ai.request.max_tokens"
TEMPERATURE = "gen_ai.request.temperature"
TOP_P = "gen_ai.request.top_p"
PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
FINISH_REASONS = "gen_ai.response.finish_reasons"
TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
E2E = "gen_ai.latency.e2e"
TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
KV_TRANSFER_TIME = "gen_ai.latency.kv_cache_transfer_time"
# OpenTelemetry's RPC and server conventions, for the router's calls to workers.
RPC_SYSTEM = "rpc.system"
RPC_METHOD = "rpc.method"
SERVER_ADDRESS = "server.address"
# pdserve's own.
ATTEMPT = "pdserve.attempt"  # the attempt's number: 0, then 1 after a migration
ATTEMPT_KIND = "pdserve.attempt.kind"  # remote (a prefill worker) or local (the decode worker)
WORKER_ID = "pdserve.worker.id"
ROUTE_RULE = "pdserve.route.rule"  # which routing rule picked the prefill worker
CACHED_TOKENS = "pdserve.cached_tokens"  # prompt tokens the worker's prefix cache held
CHUNK_TOKENS = "pdserve.chunk.computed_tokens"  # prompt tokens computed once this chunk ran
CHUNKS = "pdserve.prefill.chunks"
KV_BYTES = "pdserve.kv_transfer.bytes"
KV_BLOCKS = "pdserve.kv_transfer.blocks"
KV_BACKEND = "pdserve.kv_transfer.backend"
KV_SOURCE = "pdserve.kv_transfer.source"  # the prefill worker's address
LOST = "pdserve.attempt.lost"  # why an attempt was given up (then the next one migrates it)

TRACE_HEADERS = ("traceparent", "tracestate")
EXPORT_DELAY_MS = 1000  # a batch leaves at least this often (the SDK's default is 5 s)

_tracer = None  # an SDK Tracer once configured with an endpoint
_endpoint: str | None = None
_clock_offset_ns = 0  # time.time_ns() - time.monotonic_ns(), read once at configure


def enabled() -> bool:
    """Whether this process exports traces."""
    return _tracer is not None


def configure(endpoint: str | None, role: str, instance: str = "") -> None:
    """Export this process's spans to the OTLP/gRPC ``endpoint`` (``host:port`` or a URL);
    None leaves tracing off and imports nothing. Once per process: a second call with the
    same endpoint does nothing, with another it is refused (spans would split between two)."""
    global _tracer, _endpoint, _clock_offset_ns
    if not endpoint:
        return
    if _tracer is not None:
        if endpoint != _endpoint:
            raise ValueError(f"tracing already exports to {_endpoint}; cannot switch to {endpoint}")
        return
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attributes = {"service.name": f"pdserve-{role}"}
    if instance:
        attributes["service.instance.id"] = instance
    provider = TracerProvider(resource=Resource.create(attributes))
    # Plaintext unless the URL says https: a collector beside the cluster, as vLLM's default.
    exporter = OTLPSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https://"))
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=EXPORT_DELAY_MS))
    _clock_offset_ns = time.time_ns() - time.monotonic_ns()
    _tracer, _endpoint = provider.get_tracer("pdserve"), endpoint


def wall_ns(monotonic_s: float) -> int:
    """A ``time.monotonic()`` reading as the epoch nanoseconds spans take."""
    return int(monotonic_s * 1e9) + _clock_offset_ns


def _context(parent):
    """A parent given as a span or a context (None: a new trace) as a context."""
    if parent is None or isinstance(parent, dict):  # a Context is a dict; None starts a trace
        return parent
    from opentelemetry import trace

    return trace.set_span_in_context(parent)


def start_span(name: str, parent=None, attributes: Mapping[str, Any] | None = None, kind: str = "internal",
               start_s: float | None = None):
    """A span under ``parent`` (a span, an extracted context, or None), started now or at
    ``start_s`` (monotonic seconds); None while tracing is off. ``kind``: internal, server
    or client."""
    if _tracer is None:
        return None
    from opentelemetry.trace import SpanKind

    return _tracer.start_span(name, context=_context(parent), kind=SpanKind[kind.upper()],
                              attributes=attributes, start_time=None if start_s is None else wall_ns(start_s))


def server_span(context, name: str, attributes: Mapping[str, Any] | None = None):
    """A worker's span of one RPC, under the caller's span that the call's metadata carries
    (``context``: the grpc.aio servicer context); None while off."""
    if _tracer is None:
        return None
    return start_span(name, extract(context.invocation_metadata()), attributes, kind="server")


def end_span(span, error: BaseException | str | None = None, end_s: float | None = None,
             attributes: Mapping[str, Any] | None = None) -> None:
    """End ``span`` (None: nothing to do), with ``attributes`` added and an error status
    when ``error`` is given."""
    if span is None:
        return
    if attributes:
        span.set_attributes(attributes)
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        if isinstance(error, BaseException):
            span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, str(error)))
    span.end(end_time=None if end_s is None else wall_ns(end_s))


def record_span(name: str, parent, start_s: float, end_s: float, attributes: Mapping[str, Any] | None = None):
    """A span that already happened, from its monotonic start and end (None while off)."""
    span = start_span(name, parent, attributes, start_s=start_s)
    end_span(span, end_s=max(start_s, end_s))
    return span


def add_event(span, name: str, attributes: Mapping[str, Any] | None = None) -> None:
    if span is not None:
        span.add_event(name, attributes=attributes)


def inject(span) -> tuple[tuple[str, str], ...] | None:
    """The gRPC metadata that carries ``span`` as the remote parent (None while off)."""
    if span is None:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=_context(span))
    return tuple(carrier.items())


_NO_KWARGS: Mapping[str, Any] = {}


def metadata_kwargs(span) -> Mapping[str, Any]:
    """``metadata=`` for a stub call carrying ``span`` (nothing at all while off, so that a
    call reads as it did without tracing)."""
    return _NO_KWARGS if span is None else {"metadata": inject(span)}


def extract(pairs: Iterable[tuple[str, Any]] | Mapping[str, Any] | None):
    """The remote parent that gRPC metadata or HTTP headers carry (``traceparent`` and
    ``tracestate``, names in any case), or None: then a span under it starts a new trace.
    None while tracing is off."""
    if _tracer is None or not pairs:
        return None
    items = pairs.items() if isinstance(pairs, Mapping) else pairs
    carrier = {k.lower(): v for k, v in items if isinstance(v, str) and k.lower() in TRACE_HEADERS}
    if "traceparent" not in carrier:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(carrier)
