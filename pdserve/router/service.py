"""The public ``pdserve.v1.Generation`` service.

Every method takes its request as raw bytes and decodes it itself (``add_to``): grpc.aio
answers a message its deserializer cannot read with UNKNOWN ("Unexpected DecodeError"); a
client that sent garbage must get INVALID_ARGUMENT.

Request ids are the client's choice, so a running request belongs to the caller that started
it (``caller``): ``Abort`` reaches only the caller's own requests, and two clients may run the
same id side by side. On the workers each attempt has an unguessable id of its own
(``pdserve.router.attempts.attempt_id``).
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
from pdserve.router.cache_salt import key_salt
from pdserve.router.client_work import ClientWork
from pdserve.router.frontend import ModelInfo, check_request_id, prepare
from pdserve.router.errors import RouteError
from pdserve.router.request_run import RequestRun
from pdserve.router.request_spans import end_request, start_request, traced_prepare
from pdserve.router.limits import RouterLimits
from pdserve.router.pool import WorkerPool
from pdserve.wire import tracing
from pdserve.wire.grpc_util import abort_invalid

log = logging.getLogger(__name__)
SERVICE = "pdserve.v1.Generation"
T = TypeVar("T")


class GenerationService:
    def __init__(self, model: ModelInfo, pool: WorkerPool, limits: RouterLimits, salt_by_api_key: bool = False):
        self.model = model
        self.pool = pool
        self.limits = limits
        # An API key is configured: each caller's key (a hash of it) salts its prefix cache.
        self.salt_by_api_key = salt_by_api_key
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
                  owner: str = "", max_tokens_to_context: bool = False, authorization: str | None = None,
                  trace_headers=None) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
        """One request's responses, for every front (gRPC here, HTTP in http_api.py).
        ``owner`` is who may abort it (``caller``); the HTTP front, whose ids the router
        makes, aborts by closing the stream and passes none. ``max_tokens_to_context``: see
        ``pdserve.router.frontend.prepare``. ``authorization``: the caller's credentials, whose key
        salts its prefix cache when ``salt_by_api_key`` (``pdserve.router.cache_salt``).
        ``trace_headers``: the caller's gRPC metadata or HTTP headers, whose ``traceparent``
        the request's trace continues (read only while tracing is on).

        Raises ``InvalidRequestError`` or ``RouteError``; an ``Abort`` ends the stream with a
        FINISH_REASON_ABORT response, a cancelled caller cleans up on the way out.
        """
        arrived = time.monotonic()  # TTFT and e2e latency include tokenizing and the chat template
        deadline_s = self.timeout_s(timeout_s)
        self._admit()
        spans = start_request(trace_headers, request, self.model)  # None: tracing is off
        self.waiting += 1
        waiting = True
        run = prepared = first_at = None
        finish, error = "", None
        try:
            tenant = key_salt(authorization) if self.salt_by_api_key else ""
            args = (request, self.model, self.limits.requests, max_tokens_to_context, tenant)
            prepared = await (self.work.run(prepare, *args) if spans is None else
                              self.work.run(traced_prepare, spans, *args))
            rid = prepared.request_id
            key = (owner, rid)
            if key in self.running:
                raise InvalidRequestError("request_id", f"{rid!r} is already running")
            run = RequestRun(prepared, self.model, self.pool, self.limits, arrived=arrived, timeout_s=deadline_s,
                             spans=spans)
            self.running[key] = (asyncio.current_task(), run)
            try:
                async for resp in run.responses():
                    if waiting:
                        self.waiting, waiting = self.waiting - 1, False
                        first_at = time.monotonic()
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
            if spans is not None:
                end_request(spans, arrived, first_at, len(prepared.prompt_token_ids) if prepared else 0,
                            len(run.output.token_ids) if run else 0,
                            finish or ("" if isinstance(error, Exception) or error is None else "cancelled"),
                            error if isinstance(error, Exception) else None)  # not the client leaving

    async def client_job(self, fn: Callable[..., T], *args) -> T:
        """``fn(*args)`` on the tokenizer threads for a request that is not a generation
        (``/tokenize``, ``/detokenize``): admitted as one (``_admit``, counted as waiting),
        and refused when the tokenizer queue is full."""
        self._admit()
        self.waiting += 1
        try:
            return await self.work.run(fn, *args)
        finally:
            self.waiting -= 1

    def _admit(self) -> None:
        """Refuse at once, before any work: while draining, or past ``max_waiting_requests``."""
        if self.draining:
            raise RouteError(grpc.StatusCode.UNAVAILABLE, "the router is shutting down and takes no new request")
        if self.waiting >= self.limits.max_waiting_requests:
            raise RouteError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"{self.waiting} requests are already waiting for their first token; the limit is "
                             f"max_waiting_requests={self.limits.max_waiting_requests}")

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
            authorization = None
            if self.salt_by_api_key:  # the key the interceptor accepted salts this caller's cache
                authorization = dict(context.invocation_metadata() or ()).get("authorization")
            headers = context.invocation_metadata() if tracing.enabled() else None  # its traceparent
            async for resp in self.run(request, remaining, caller(context), authorization=authorization,
                                       trace_headers=headers):
                yield resp
        except InvalidRequestError as exc:
            await abort_invalid(context, exc)
        except RouteError as exc:
            if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                context.set_trailing_metadata((("retry-after", str(self.limits.retry_after_s)),))
            await context.abort(exc.code, str(exc))

    async def Abort(self, request, context):
        """Abort the caller's own request of that id; another client's is not found. The id
        is checked as ``Generate`` checks it (it is logged the same way)."""
        try:
            check_request_id(request.request_id, self.limits.requests)
        except InvalidRequestError as exc:
            await abort_invalid(context, exc)
        key = (caller(context), request.request_id)
        entry = self.running.get(key)
        if entry is None:
            return pdserve_pb2.AbortResponse(found=False)
        self.aborted.add(key)
        entry[0].cancel()
        return pdserve_pb2.AbortResponse(found=True)

    async def ListModels(self, request, context):
        return pdserve_pb2.ListModelsResponse(models=[pdserve_pb2.ModelInfo(
            id=name, max_model_len=self.model.max_model_len, vocab_size=self.model.config.vocab_size)
            for name in self.model.names])

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
    """Who a public call comes from: the identity in its client certificate when the public
    plane verifies them (any connection of that client), else the connection it came over
    (``host:port`` of the peer). The one API key is shared by every client, so it names no
    one. A client aborts over the channel it generates on."""
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
