"""OpenAI-compatible HTTP front of the router (aiohttp, on the router's event loop).

``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream`` true or false; SSE
chunks in OpenAI's format ending with ``data: [DONE]``; ``stream_options.include_usage``),
``GET /v1/models``, ``GET /health`` (503 while no prefill or no decode worker is ready),
``GET /metrics`` and ``GET /metrics/targets`` (Prometheus HTTP service discovery of the
workers' own endpoints). Each request becomes a ``pdserve.v1.GenerateRequest`` (typed
models in ``router.validation``) and runs through the same ``GenerationService.run`` as
gRPC, so validation, routing and recovery are shared. A client that disconnects cancels its
handler, which aborts the request on the workers.

A client may bound a request's time with the ``X-Request-Timeout`` header (seconds; the
router's ``request_timeout_s`` caps it); past it the answer is 408 or, mid-stream, an error
event. A 429 carries ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, AsyncIterator

import grpc
from aiohttp import web

from engine.errors import InvalidRequestError
from router import auth
from router.openai_format import chat_chunk, chat_response, completion_chunk, completion_response, usage_dict
from router.orchestrator import RouteError
from router.service import GenerationService
from router.validation import HttpError, decode_json, parse_body
from wire.address import Endpoint, resolve
from wire.logs import ACCESS_FORMAT, ACCESS_LOGGER
from wire.tls import TlsConfig

_ROUTE_STATUS = {grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_exceeded"),
                 grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
                 grpc.StatusCode.DEADLINE_EXCEEDED: (408, "timeout")}
TIMEOUT_HEADER = "X-Request-Timeout"
_PARSE_OFF_LOOP_BYTES = 64 << 10  # larger bodies are parsed on a thread, not the event loop


def error_response(status: int, message: str, kind: str, param: str | None = None,
                   retry_after_s: int | None = None) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    headers = {"Retry-After": str(retry_after_s)} if status == 429 and retry_after_s is not None else None
    return web.json_response(body, status=status, headers=headers)


def _as_http_error(exc: Exception) -> HttpError:
    if isinstance(exc, HttpError):
        return exc
    if isinstance(exc, InvalidRequestError):
        if exc.field == "model":
            return HttpError(404, str(exc), "NotFoundError", "model")
        return HttpError(400, str(exc), "BadRequestError", exc.field)
    if isinstance(exc, RouteError):
        status, kind = _ROUTE_STATUS.get(exc.code, (503, "service_unavailable"))
        return HttpError(status, str(exc), kind)
    raise exc


class OpenAIFront:
    def __init__(self, service: GenerationService):
        self.service = service

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.service.limits.requests.max_body_bytes)
        app.add_routes([
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.get("/v1/models", self.models),
            web.get("/health", self.health),
            web.get("/metrics", self.metrics),
            web.get("/metrics/targets", self.metrics_targets),
        ])
        return app

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    def _error(self, exc: Exception) -> web.Response:
        err = _as_http_error(exc)
        return error_response(err.status, str(err), err.kind, err.param, self.service.limits.retry_after_s)

    async def _read(self, request: web.Request, chat: bool):
        """The body, read within ``max_body_bytes`` and parsed once; raises ``HttpError``."""
        limit = self.service.limits.requests.max_body_bytes
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise HttpError(400, f"body is over the router's limit max_body_bytes={limit}", param="body") from None
        name = self.service.model.names
        if len(raw) > _PARSE_OFF_LOOP_BYTES:
            return await asyncio.to_thread(lambda: parse_body(decode_json(raw), chat, name))
        return parse_body(decode_json(raw), chat, name)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            timeout_s = _timeout(request)
            req, options = await self._read(request, chat)
        except HttpError as exc:
            return self._error(exc)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        req.request_id = rid
        stream = self.service.run(req, timeout_s)
        try:
            first = await anext(stream)  # validation and routing errors surface before any byte is sent
        except StopAsyncIteration:
            first = None
        except (InvalidRequestError, RouteError, HttpError) as exc:
            return self._error(exc)
        meta = {"id": rid, "created": int(time.time()), "model": self.service.model.name, "chat": chat,
                "logprobs": options.logprobs, "tokenizer": self.service.model.tokenizer}
        try:
            if options.stream:
                return await self._stream(request, first, stream, meta, options.include_usage)
            return await self._collect(first, stream, meta)
        finally:
            # However the handler ends (done, cancelled by a disconnect, a write to a closed
            # socket), close the request's stream so the router aborts it on the workers.
            await stream.aclose()

    async def _collect(self, first, stream: AsyncIterator, meta: dict) -> web.Response:
        parts = [first] if first is not None else []
        try:
            async for resp in stream:
                parts.append(resp)
        except (InvalidRequestError, RouteError) as exc:
            return self._error(exc)
        build = chat_response if meta["chat"] else completion_response
        return web.json_response(build(parts, meta))

    async def _stream(self, request: web.Request, first, stream: AsyncIterator, meta: dict,
                      include_usage: bool) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        chunk = chat_chunk if meta["chat"] else completion_chunk
        if meta["chat"]:
            await _send(response, chunk(meta, role=True))
        last = None
        try:
            resp = first
            while resp is not None:
                last = resp
                if resp.token_ids or resp.text or resp.finish_reason:
                    await _send(response, chunk(meta, resp=resp))
                resp = await anext(stream, None)
        except (InvalidRequestError, RouteError) as exc:
            err = _as_http_error(exc)
            await _send(response, {"error": {"message": str(err), "type": err.kind, "param": err.param,
                                              "code": err.status}})
        if include_usage and last is not None and last.finish_reason:
            usage = last.usage
            await _send(response, {**chunk(meta, usage_only=True), "usage": usage_dict(usage)})
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def models(self, request: web.Request) -> web.Response:
        m = self.service.model
        return web.json_response({"object": "list", "data": [{
            "id": name, "object": "model", "created": 0, "owned_by": "pdserve", "max_model_len": m.max_model_len}
            for name in m.names]})

    async def health(self, request: web.Request) -> web.Response:
        if self.service.draining:
            return error_response(503, "the router is shutting down", "service_unavailable")
        if self.service.pool.ready():
            return web.json_response({"status": "ok"})
        return error_response(503, "no ready prefill worker or no ready decode worker", "service_unavailable")

    async def metrics(self, request: web.Request) -> web.Response:
        from wire import metrics

        body, content_type = metrics.render()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def metrics_targets(self, request: web.Request) -> web.Response:
        return web.json_response(self.service.pool.metrics_targets())


def _timeout(request: web.Request) -> float | None:
    value = request.headers.get(TIMEOUT_HEADER)
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise HttpError(400, f"{TIMEOUT_HEADER} must be a positive number of seconds, got {value!r}",
                        param=TIMEOUT_HEADER)
    return seconds


async def _send(response: web.StreamResponse, payload: dict[str, Any]) -> None:
    await response.write(f"data: {json.dumps(payload)}\n\n".encode())


async def start(service: GenerationService, host: str | Endpoint, port: int, *, api_key: str | None = None,
                tls: TlsConfig | None = None) -> tuple[web.AppRunner, str]:
    """Serve the front on ``host:port`` (0: any free port), behind ``api_key`` (``router.auth``)
    and over HTTPS with ``tls``; returns the runner and the advertised address."""
    endpoint = host if isinstance(host, Endpoint) else resolve(host)
    app = OpenAIFront(service).app()
    if api_key:
        app.middlewares.append(auth.http_middleware(api_key))
    # handler_cancellation: a client that disconnects cancels its handler (aiohttp's default
    # since 3.9 is to let it run on), so its request stops using the workers at once.
    runner = web.AppRunner(app, access_log=ACCESS_LOGGER, access_log_format=ACCESS_FORMAT, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, endpoint.bind_host, port, ssl_context=tls.http_server_context() if tls else None)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # aiohttp exposes no public accessor for port 0
    return runner, endpoint.advertise(bound)
