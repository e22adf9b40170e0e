"""A request's spans in the router (``pdserve.wire.tracing``), made only while tracing is on.

    router.request                       the client's request (under its traceparent, if sent)
    ├── router.validate / router.tokenize
    └── router.attempt  (one per attempt; a migration adds the next)
        ├── router.route  (pool prefill | decode: the admission wait and the pick)
        ├── router.call Prefill  ──▶ the prefill worker's spans
        └── router.call Decode   ──▶ the decode worker's spans (the KV transfer among them)

A run holds a ``RequestSpans`` (``CallContext.spans``) while tracing is on, and None while it
is off: every call site checks that once, so the off path makes no span and imports nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from pdserve.protos import pdserve_pb2
from pdserve.router.frontend import ModelInfo, PreparedRequest, tokenize, validate
from pdserve.router.validation import RequestLimits
from pdserve.wire import tracing


@dataclass
class RequestSpans:
    """The spans a request's calls hang under: the request's own, and the attempt running now
    (attempts of a request run one after another)."""

    request: Any
    attempt: Any = None

    def start_attempt(self, number: int, kind: str, prompt_tokens: int) -> None:
        self.attempt = tracing.start_span("router.attempt", self.request, {
            tracing.ATTEMPT: number, tracing.ATTEMPT_KIND: kind, tracing.PROMPT_TOKENS: prompt_tokens})

    def end_attempt(self, lost: BaseException | None = None) -> None:
        """The attempt ended: done, or ``lost`` (the next attempt migrates the request)."""
        attributes = {tracing.LOST: str(lost)} if lost is not None else None
        tracing.end_span(self.attempt, error=lost, attributes=attributes)
        self.attempt = None

    def route(self, pool: str):
        """The span of one pick of a worker in ``pool`` (admission wait included)."""
        return tracing.start_span("router.route", self.attempt, {"pdserve.pool": pool})

    def call(self, method: str, address: str):
        """A client span for one RPC to a worker; ``tracing.inject`` makes its metadata."""
        return tracing.start_span(f"router.call {method}", self.attempt, {
            tracing.RPC_SYSTEM: "grpc", tracing.RPC_METHOD: method, tracing.SERVER_ADDRESS: address}, kind="client")


def start_request(headers, request: pdserve_pb2.GenerateRequest, model: ModelInfo) -> RequestSpans | None:
    """The request's spans, under the client's trace context (``headers``: its gRPC metadata
    or HTTP headers); None while tracing is off."""
    if not tracing.enabled():
        return None
    span = tracing.start_span("router.request", tracing.extract(headers), {
        tracing.RESPONSE_MODEL: model.name, tracing.MAX_TOKENS: request.sampling.max_tokens,
        tracing.TEMPERATURE: request.sampling.temperature, tracing.TOP_P: request.sampling.top_p}, kind="server")
    return RequestSpans(span)


def traced_prepare(spans: RequestSpans, req: pdserve_pb2.GenerateRequest, model: ModelInfo, limits: RequestLimits,
                   max_tokens_to_context: bool, tenant: str) -> PreparedRequest:
    """``frontend.prepare``, each half a span (on the tokenizer thread, as ``prepare`` runs)."""
    start = time.monotonic()
    step, name = start, "router.validate"
    try:
        valid = validate(req, model, limits, max_tokens_to_context, tenant)
        tracing.record_span(name, spans.request, start, time.monotonic())
        step, name = time.monotonic(), "router.tokenize"
        prepared = tokenize(valid, model)
    except Exception as exc:
        tracing.end_span(tracing.start_span(name, spans.request, start_s=step), error=exc)
        raise
    tracing.record_span(name, spans.request, step, time.monotonic(), {tracing.PROMPT_TOKENS: len(prepared.prompt_token_ids)})
    spans.request.set_attribute(tracing.REQUEST_ID, prepared.request_id)
    return prepared


def end_request(spans: RequestSpans | None, arrived: float, first_at: float | None, prompt_tokens: int,
                completion_tokens: int, finish_reason: str, error: BaseException | None = None) -> None:
    """End the request's span with its usage and latencies (monotonic seconds)."""
    if spans is None:
        return
    now = time.monotonic()
    attributes = {tracing.PROMPT_TOKENS: prompt_tokens, tracing.COMPLETION_TOKENS: completion_tokens,
                  tracing.E2E: now - arrived}
    if finish_reason:
        attributes[tracing.FINISH_REASONS] = (finish_reason,)
    if first_at is not None:
        attributes[tracing.TIME_TO_FIRST_TOKEN] = first_at - arrived
    spans.end_attempt()  # an attempt still open when the request ends (cancelled, failed)
    tracing.end_span(spans.request, error=error, attributes=attributes)
