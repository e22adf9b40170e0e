"""The public ``pdserve.v1.Generation`` service.

Every method takes its request as raw bytes and decodes it itself (``add_to``): grpc.aio
answers a message its deserializer cannot read with UNKNOWN ("Unexpected DecodeError"); a
client that sent garbage must get INVALID_ARGUMENT.

Request ids are the client's choice, so a running request belongs to the caller that started
it (``owner``): with API keys, its tenant (``pdserve.router.tenants``), whatever connection or
proxy it came through; without, the client's certificate or connection (``caller``). ``Abort``
reaches only the owner's own requests, and two owners may run the same id side by side. On
the workers each attempt has an unguessable id of its own (``pdserve.router.attempts.attempt_id``).

Admission, before any work: the tenant's own limits first (``pdserve.router.tenant_admission``:
its excess is its own 429, naming its limit), then the router's shared ones.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import AsyncIterator, Callable, TypeVar

import grpc
from google.protobuf.message import DecodeError

from pdserve.engine.errors import InvalidRequestError
from pdserve.router.request_trace import TraceWriter
from pdserve.protos import pdserve_pb2
from pdserve.router.auth import ApiKeys
from pdserve.router.client_work import ClientWork
from pdserve.router.frontend import ModelInfo, check_request_id, prepare
from pdserve.router.errors import RouteError, invalid_status
from pdserve.router.request_run import RequestRun
from pdserve.router.request_spans import end_request, start_request, traced_prepare
from pdserve.router.limits import RouterLimits
from pdserve.router.pool import WorkerPool
from pdserve.router.tenant_admission import TenantAdmission, TenantLimitError
from pdserve.router.tenants import Tenant
from pdserve.wire import tracing
from pdserve.wire.grpc_util import abort_invalid

log = logging.getLogger(__name__)
SERVICE = "pdserve.v1.Generation"
T = TypeVar("T")


class GenerationService:
    def __init__(self, model: ModelInfo, pool: WorkerPool, limits: RouterLimits, keys: ApiKeys | None = None):
        self.model = model
        self.pool = pool
        self.limits = limits
        # API keys are configured: every caller is a tenant, which salts its prefix cache, owns
        # its requests and has its own limits.
        self.keys = keys
        self.tenants = TenantAdmission(limits.retry_after_s)
        self.running: dict[tuple[str, str], tuple[asyncio.Task, RequestRun]] = {}  # (owner, request id)
        self.aborted: set[tuple[str, str]] = set()
        self.waiting = 0  # requests admitted that have not had their first response yet
        self.draining = False
        # Readiness false while it still serves what reaches it: a rolling restart's old router
        # until it stops listening (pdserve.router.handover).
        self.unready = False
        # Tokenization, chat templates and large bodies off the event loop, in a bounded queue.
        self.work = ClientWork(limits.tokenizer_threads, limits.max_tokenizer_queue)
        self.trace = TraceWriter.from_env()  # planner replay: PDSERVE_TRACE_FILE records lengths per request

    def timeout_s(self, client_timeout_s: float | None) -> float:
        """The request's deadline from now: the client's, capped by ``request_timeout_s``."""
        if client_timeout_s is None:
            return self.limits.request_timeout_s
        if not client_timeout_s > 0 or math.isinf(client_timeout_s):
            raise InvalidRequestError("timeout", f"must be a positive number of seconds, got {client_timeout_s}")
        return min(client_timeout_s, self.limits.request_timeout_s)

    async def run(self, request: pdserve_pb2.GenerateRequest, timeout_s: float | None = None,
                  owner: str = "", max_tokens_to_context: bool = False, tenant: Tenant | None = None,
                  trace_headers=None, session_id: str | None = None) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
        """One request's responses, for every front (gRPC here, HTTP in http_api.py).
        ``tenant``: the caller's, from its API key (None: no keys configured); it salts the
        request's prefix cache (``pdserve.router.cache_salt``), owns it, and its limits admit
        it. ``owner``, without a tenant, is who may abort it (``caller``); the HTTP front, whose
        ids the router makes, aborts by closing the stream and passes none.
        ``max_tokens_to_context``: see ``pdserve.router.frontend.prepare``. ``trace_headers``:
        the caller's gRPC metadata or HTTP headers, whose ``traceparent`` the request's trace
        continues (read only while tracing is on). ``session_id``: the client's session hint
        (HTTP body's ``session_id``, ``pdserve.router.session_hint``).

        Raises ``InvalidRequestError`` or ``RouteError``; an ``Abort`` ends the stream with a
        FINISH_REASON_ABORT response, a cancelled caller cleans up on the way out.
        """
        arrived = time.monotonic()  # TTFT and e2e latency include tokenizing and the chat template
        deadline_s = self.timeout_s(timeout_s)
        ticket = self._admit(tenant)
        self.waiting += 1
        waiting = True
        run = prepared = first_at = spans = None
        finish, error = "", None
        try:
            spans = start_request(trace_headers, request, self.model)  # None: tracing is off
            args = (request, self.model, self.limits.requests, max_tokens_to_context,
                    tenant.salt if tenant is not None else "")
            prepared = await (self.work.run(prepare, *args) if spans is None else
                              self.work.run(traced_prepare, spans, *args))
            ticket.used(len(prepared.prompt_token_ids))
            rid = prepared.request_id
            key = (tenant.owner if tenant is not None else owner, rid)
            if key in self.running:
                raise InvalidRequestError("request_id", f"{rid!r} is already running")
            run = RequestRun(prepared, self.model, self.pool, self.limits, arrived=arrived, timeout_s=deadline_s,
                             spans=spans, session_id=session_id)
            self.running[key] = (asyncio.current_task(), run)
            try:
                async for resp in run.responses():
                    if waiting:
                        self.waiting, waiting = self.waiting - 1, False
                        first_at = time.monotonic()
                        ticket.started()
                    ticket.used(len(resp.token_ids))
                    if spans is not None and resp.finish_reason:
                        finish = pdserve_pb2.FinishReason.Name(resp.finish_reason)
                    yield resp
            except asyncio.CancelledError:
                if key not in self.aborted:
                    raise  # the client went away; cleanup ran on the way out
                finish = "FINISH_REASON_ABORT"
                yield pdserve_pb2.GenerateResponse(request_id=rid, finish_reason=pdserve_pb2.FINISH_REASON_ABORT,
                                                   usage=run.usage())
            finally:
                if self.trace is not None:
                    self.trace.record(prepared.prompt_token_ids, len(run.output.token_ids), arrived)
                self.running.pop(key, None)
                self.aborted.discard(key)
        except BaseException as exc:
            error = exc
            raise
        finally:
            if waiting:
                self.waiting -= 1
            ticket.done()
            if spans is not None:
                end_request(spans, arrived, first_at, len(prepared.prompt_token_ids) if prepared else 0,
                            len(run.output.token_ids) if run else 0,
                            finish or ("" if isinstance(error, Exception) or error is None else "cancelled"),
                            error if isinstance(error, Exception) else None)  # not the client leaving

    async def client_job(self, fn: Callable[..., T], *args, tenant: Tenant | None = None) -> T:
        """``fn(*args)`` on the tokenizer threads for a request that is not a generation
        (``/tokenize``, ``/detokenize``): admitted as one (``_admit``, counted as waiting, its
        tenant's too), and refused when the tokenizer queue is full."""
        ticket = self._admit(tenant)
        self.waiting += 1
        try:
            return await self.work.run(fn, *args)
        finally:
            self.waiting -= 1
            ticket.done()

    def _admit(self, tenant: Tenant | None):
        """Refuse at once, before any work: while draining, past the tenant's own limits
        (``TenantLimitError``), or past ``max_waiting_requests``. Returns the tenant's ticket."""
        if self.draining:
            raise RouteError(grpc.StatusCode.UNAVAILABLE, "the router is shutting down and takes no new request")
        ticket = self.tenants.admit(tenant)
        if self.waiting >= self.limits.max_waiting_requests:
            ticket.done()
            raise RouteError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"{self.waiting} requests are already waiting for their first token; the limit is "
                             f"max_waiting_requests={self.limits.max_waiting_requests}")
        return ticket

    def retry_after_s(self, exc: RouteError) -> int:
        """The Retry-After of a RESOURCE_EXHAUSTED: a tenant limit's own, else the router's."""
        return exc.retry_after_s if isinstance(exc, TenantLimitError) else self.limits.retry_after_s

    def tenant_of(self, authorization: str | None) -> Tenant | None:
        """The caller's tenant from its ``authorization`` (gRPC metadata, HTTP header), whose
        key the front's check passed; None without keys."""
        return self.keys.tenant_of(authorization) if self.keys is not None else None

    def grpc_tenant(self, context: grpc.aio.ServicerContext) -> Tenant | None:
        if self.keys is None:
            return None
        return self.tenant_of(dict(context.invocation_metadata() or ()).get("authorization"))

    def owner_of(self, context: grpc.aio.ServicerContext) -> str:
        """Who a gRPC caller is as an owner of requests: its tenant, else ``caller``."""
        tenant = self.grpc_tenant(context)
        return tenant.owner if tenant is not None else caller(context)

    async def drain(self, grace_s: float, poll_s: float = 0.1) -> int:
        """Stop admitting; wait up to ``grace_s`` for running requests to finish. Returns how
        many were still running when it gave up (0: all finished)."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while (self.running or self.waiting) and loop.time() < deadline:
            await asyncio.sleep(poll_s)
        return len(self.running) + self.waiting

    # ---- gRPC methods ----------------------------------------------------------------
    async def Generate(self, request, context):
        remaining = context.time_remaining()  # None: the client set no deadline
        if remaining is not None and remaining <= 0:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the client's deadline passed before the request began")
        try:
            headers = context.invocation_metadata() if tracing.enabled() else None  # its traceparent
            async for resp in self.run(request, remaining, caller(context), tenant=self.grpc_tenant(context),
                                       trace_headers=headers):
                yield resp
        except InvalidRequestError as exc:
            await abort_invalid(context, exc, invalid_status(exc))
        except RouteError as exc:
            if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                context.set_trailing_metadata((("retry-after", str(self.retry_after_s(exc))),))
            await context.abort(exc.code, str(exc))

    async def Abort(self, request, context):
        """Abort the caller's own request of that id (its tenant's, with API keys); another
        owner's is not found. The id is checked as ``Generate`` checks it (it is logged the
        same way)."""
        try:
            check_request_id(request.request_id, self.limits.requests)
        except InvalidRequestError as exc:
            await abort_invalid(context, exc)
        key = (self.owner_of(context), request.request_id)
        entry = self.running.get(key)
        if entry is None:
            return pdserve_pb2.AbortResponse(found=False)
        self.aborted.add(key)
        entry[0].cancel()
        return pdserve_pb2.AbortResponse(found=True)

    async def ListModels(self, request, context):
        return pdserve_pb2.ListModelsResponse(models=[pdserve_pb2.ModelInfo(
            id=name, max_model_len=self.model.max_model_len, vocab_size=self.model.config.vocab_size)
            for name in self.model.served_names()])

    def add_to(self, server: grpc.aio.Server) -> None:
        """Register the service with raw-bytes request deserializers (see the module doc)."""
        max_bytes = self.limits.requests.max_body_bytes
        handlers = {
            "Generate": grpc.unary_stream_rpc_method_handler(
                _streaming(self.Generate, pdserve_pb2.GenerateRequest, max_bytes),
                response_serializer=pdserve_pb2.GenerateResponse.SerializeToString),
            "Abort": grpc.unary_unary_rpc_method_handler(
                _unary(self.Abort, pdserve_pb2.AbortRequest, max_bytes),
                response_serializer=pdserve_pb2.AbortResponse.SerializeToString),
            "ListModels": grpc.unary_unary_rpc_method_handler(
                _unary(self.ListModels, pdserve_pb2.ListModelsRequest, max_bytes),
                response_serializer=pdserve_pb2.ListModelsResponse.SerializeToString),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


def caller(context: grpc.aio.ServicerContext) -> str:
    """Who a public call comes from when no API keys name tenants: the identity in its client
    certificate when the public plane verifies them (any connection of that client), else the
    connection it came over (``host:port`` of the peer). Such a client aborts over the
    channel it generates on."""
    identities = context.peer_identities()
    if identities:
        return "cert:" + b",".join(identities).decode(errors="replace")
    return "peer:" + context.peer()


async def _decode(cls, raw: bytes, max_bytes: int, context):
    """``raw`` as a ``cls`` message, or the call ends with INVALID_ARGUMENT naming why."""
    if len(raw) > max_bytes:
        await abort_invalid(context, InvalidRequestError(
            "max_body_bytes", f"the message is {len(raw)} bytes; the limit is {max_bytes}", max_bytes))
    try:
        return cls.FromString(raw)
    except (DecodeError, RuntimeError, ValueError) as exc:  # upb may raise any of them on garbage
        await abort_invalid(context, InvalidRequestError("request", f"not a valid {cls.__name__} message: {exc}"))


def _unary(method, cls, max_bytes: int):
    async def handler(raw: bytes, context):
        return await method(await _decode(cls, raw, max_bytes, context), context)

    return handler


def _streaming(method, cls, max_bytes: int):
    async def handler(raw: bytes, context):
        request = await _decode(cls, raw, max_bytes, context)
        async for resp in method(request, context):
            yield resp

    return handler
