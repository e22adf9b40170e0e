"""OpenAI-compatible HTTP front of the router (aiohttp, on the router's event loop).

``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream`` true or false; SSE
chunks in OpenAI's format ending with ``data: [DONE]``; ``stream_options.include_usage``),
``GET /v1/models`` with the LoRA adapters and their load and unload (``pdserve.router.models_api``), ``GET /health`` (503 while no prefill or no decode worker is ready),
``GET /metrics`` and ``GET /metrics/targets`` (Prometheus HTTP service discovery of the
workers' own endpoints). Each request becomes a ``pdserve.v1.GenerateRequest`` (typed
models in ``pdserve.router.validation``) and runs through the same ``GenerationService.run`` as
gRPC, so validation, routing and recovery are shared. A client that disconnects cancels its
handler, which aborts the request on the workers.

A client may bound a request's time with the body's ``timeout`` field or the
``X-Request-Timeout`` header (seconds; the sooner of the two, and the router's
``request_timeout_s`` caps it); past it the answer is 408 or, mid-stream, an error
event. A 429 carries ``Retry-After``.

The event loop never waits on a client (``pdserve.router.client_work``): bodies above
``INLINE_BYTES`` or asking for a grammar are parsed, and every tokenizer call (``/tokenize``,
``/detokenize``, an echoed prompt, logprob token strings) runs, on the router's tokenizer
threads, in a bounded queue. Slow clients time out: headers (``http_header_timeout_s``), body
(``http_body_timeout_s``), and a stream the client stops reading (``stream_idle_timeout_s``).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import time
import uuid
from typing import Any, AsyncIterator

from aiohttp import web

from pdserve.engine.errors import InvalidRequestError
from pdserve.router import auth
from pdserve.router.client_work import INLINE_BYTES
from pdserve.router.openai_format import (Choice, chat_chunk, chat_response, completion_chunk, completion_response,
                                  usage_dict)
from pdserve.router.errors import RouteError
from pdserve.router.lora_admin import LoRAAdmin
from pdserve.router.models_api import ModelsFront
from pdserve.router.service import GenerationService
from pdserve.router.tokenize_api import detokenize_request, tokenize_request
from pdserve.router.tools import ToolOutput
from pdserve.router.http_errors import as_http_error, error_response
from pdserve.router.validation import HttpError, converts_grammar, decode_json, parse_body
from pdserve.wire.address import Endpoint, resolve
from pdserve.wire.logs import ACCESS_FORMAT, ACCESS_LOGGER
from pdserve.wire import tracing
from pdserve.wire.tls import TlsConfig

TIMEOUT_HEADER = "X-Request-Timeout"
REQUEST_ID_HEADER = "X-Request-Id"  # in: the request's id on the workers; out: echoed back


class OpenAIFront:
    def __init__(self, service: GenerationService, admin: LoRAAdmin | None = None):
        self.service = service
        self.models = ModelsFront(service, admin)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.service.limits.requests.max_body_bytes,
                              middlewares=[_echo_request_id])
        app.add_routes([
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            *self.models.routes(),  # /v1/models, and the LoRA adapters' load and unload (router.models_api)
            web.post("/tokenize", self.tokenize),
            web.post("/detokenize", self.detokenize),
            web.get("/version", self.version),
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
        err = as_http_error(exc)
        retry_s = self.service.retry_after_s(exc) if isinstance(exc, RouteError) else self.service.limits.retry_after_s
        return error_response(err.status, str(err), err.kind, err.param, retry_s)

    async def _raw(self, request: web.Request, max_bytes: int | None = None, limit_name: str = "max_body_bytes") -> bytes:
        """The body, read within ``max_bytes`` (default ``max_body_bytes``; a declared length
        over it is refused before any byte is read) and ``http_body_timeout_s``; raises ``HttpError``."""
        limit, timeout_s = self.service.limits.requests.max_body_bytes, self.service.limits.http_body_timeout_s
        if max_bytes is not None and (request.content_length or 0) > max_bytes:
            raise HttpError(400, f"body is {request.content_length} bytes; the limit is {limit_name}={max_bytes}",
                            param="body")
        try:
            raw = await asyncio.wait_for(request.read(), timeout_s)
            if max_bytes is not None and len(raw) > max_bytes:
                raise HttpError(400, f"body is over the limit {limit_name}={max_bytes}", param="body")
            return raw
        except web.HTTPRequestEntityTooLarge:
            raise HttpError(400, f"body is over the router's limit max_body_bytes={limit}", param="body") from None
        except TimeoutError:
            raise HttpError(408, f"the body did not arrive within the router's limit http_body_timeout_s={timeout_s:g}",
                            "timeout", param="body") from None

    async def _read(self, request: web.Request, chat: bool):
        """The body, read and parsed once (off the loop when large or when it converts a
        grammar); raises ``HttpError``."""
        raw = await self._raw(request)
        name, limits = self.service.model.served_names(), self.service.limits.requests
        if len(raw) > INLINE_BYTES:
            return await self.service.work.run(lambda: parse_body(decode_json(raw), chat, name, limits))
        body = decode_json(raw)
        if converts_grammar(body):  # a schema's conversion can take a second: off the loop too
            return await self.service.work.run(parse_body, body, chat, name, limits)
        return parse_body(body, chat, name, limits)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            timeout_s = _timeout(request)
            reqs, options = await self._read(request, chat)
            if options.timeout_s is not None:  # the body's and the header's: the sooner
                timeout_s = options.timeout_s if timeout_s is None else min(timeout_s, options.timeout_s)
            texts = await self._prompt_texts(reqs) if options.echo else [""] * len(reqs)
        except (HttpError, RouteError) as exc:
            return self._error(exc)
        parser = self.service.model.tool_parser
        if options.tools is not None and options.tools.mode == "auto" and parser is None:
            return self._error(HttpError(400, "tool_choice \"auto\" (the default with tools) needs a tool-call "
                                         "parser, and this model's chat template matches none; set "
                                         "tool_choice, or serve with --tool-call-parser", param="tool_choice"))
        body_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        # The client's X-Request-Id names the request on the workers (their logs carry it).
        rid = request.headers.get(REQUEST_ID_HEADER) or body_id
        choices = []
        for i, req in enumerate(reqs):
            req.request_id = rid if len(reqs) == 1 else f"{rid}-{i}"
            choices.append(Choice(i, prompt_text=texts[i],
                                  tools=ToolOutput(options.tools, parser) if options.tools is not None else None))
        # Without max_tokens, chat runs to the rest of the context and completions stop at 16
        # (wire.convert.DEFAULT_MAX_TOKENS), as in OpenAI's API and vLLM.
        # The key's tenant (router.auth) salts, owns and admits the request.
        tenant = self.service.tenant_of(request.headers.get("Authorization"))
        headers = request.headers if tracing.enabled() else None  # a traceparent the trace continues
        streams = [self.service.run(req, timeout_s, max_tokens_to_context=chat, tenant=tenant,
                                    trace_headers=headers, session_id=options.session_id) for req in reqs]
        queue: asyncio.Queue = asyncio.Queue()
        # One task iterates each choice's stream from start to end: the router's Abort cancels
        # the task that runs a request, so that must stay the same task throughout.
        tasks = [asyncio.create_task(_pump(c, s, queue)) for c, s in zip(choices, streams)]
        try:
            # Validation and routing errors surface before any byte is sent.
            early, started = [], set()
            while len(started) < len(choices):
                choice, item = await queue.get()
                if isinstance(item, Exception):
                    return self._error(item)
                started.add(choice.index)
                early.append((choice, item))
            meta = {"id": body_id, "created": int(time.time()), "model": self._model_of(reqs[0]), "chat": chat,
                    "logprobs": options.logprobs, "top_logprobs": options.top_logprobs, "echo": options.echo,
                    "n": options.n, "tokenizer": self.service.model.tokenizer}
            if options.stream:
                return await self._stream(request, choices, early, queue, meta, options.include_usage)
            return await self._collect(choices, early, queue, meta)
        finally:
            # However the handler ends (done, cancelled by a disconnect, a write to a closed
            # socket), stop the pumps, then close every choice's stream so the router aborts
            # it on the workers (a stream a pump still runs in cannot be closed).
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for s in streams:
                await s.aclose()

    async def _prompt_texts(self, reqs: list) -> list[str]:
        """Each prompt as echo shows it: the text sent, or the token ids' text (decoded on
        the tokenizer threads)."""
        hf = self.service.model.tokenizer.hf

        def texts() -> list[str]:
            return [r.text if r.WhichOneof("input") == "text" else hf.decode(list(r.token_ids.ids)) for r in reqs]

        return await self.service.work.run(texts)

    async def _collect(self, choices: list[Choice], early: list, queue: asyncio.Queue, meta: dict) -> web.Response:
        async for choice, item in _items(early, queue, len(choices)):
            if isinstance(item, Exception):
                return self._error(item)
            choice.parts.append(item)
        build = chat_response if meta["chat"] else completion_response
        if not (meta["logprobs"] or meta["echo"]):
            return web.json_response(build(choices, meta))
        # Token strings decode every token, an echoed prompt's too: off the loop.
        body = await self.service.work.run(lambda: json.dumps(build(choices, meta)), admitted=True)
        return web.json_response(text=body)

    async def _stream(self, request: web.Request, choices: list[Choice], early: list, queue: asyncio.Queue,
                      meta: dict, include_usage: bool) -> web.StreamResponse:
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        if REQUEST_ID_HEADER in request.headers:
            headers[REQUEST_ID_HEADER] = request.headers[REQUEST_ID_HEADER]
        response = web.StreamResponse(headers=headers)
        await response.prepare(request)
        idle_s = self.service.limits.stream_idle_timeout_s
        if meta["chat"]:
            for choice in choices:
                await _send(response, chat_chunk(meta, choice, role=True), idle_s)
        lasts: dict[int, object] = {}
        async for choice, item in _items(early, queue, len(choices)):
            if isinstance(item, Exception):
                err = as_http_error(item)
                await _send(response, {"error": {"message": str(err), "type": err.kind, "param": err.param,
                                                  "code": err.status}}, idle_s)
                break
            await self._send_part(response, meta, choice, item, idle_s, first=choice.index not in lasts)
            lasts[choice.index] = item
        done = [lasts.get(c.index) for c in choices]
        if include_usage and all(r is not None and r.finish_reason for r in done):
            await _send(response, {**(chat_chunk if meta["chat"] else completion_chunk)(meta),
                                   "usage": usage_dict([r.usage for r in done], meta["n"])}, idle_s)
        await _write(response, b"data: [DONE]\n\n", idle_s)
        await response.write_eof()
        return response

    async def _send_part(self, response: web.StreamResponse, meta: dict, choice: Choice, resp, idle_s: float,
                         first: bool = False) -> None:
        if not (resp.token_ids or resp.text or resp.finish_reason or (first and meta["echo"])):
            return
        if meta["chat"]:
            chunk = lambda: chat_chunk(meta, choice, resp)  # noqa: E731
        else:
            chunk = lambda: completion_chunk(meta, choice, resp, first=first)  # noqa: E731
        # Logprobs decode each token (and an echoed prompt's): off the loop.
        await _send(response, await self.service.work.run(chunk, admitted=True) if meta["logprobs"] else chunk(),
                    idle_s)

    def _model_of(self, req) -> str:
        """The model an answer names: the adapter the request ran, else the base model's name."""
        return req.model if req.model in self.service.model.adapters else self.service.model.name

    async def tokenize(self, request: web.Request) -> web.Response:
        m, limits = self.service.model, self.service.limits.requests

        def job(raw: bytes) -> str:  # parse, check, tokenize: all on the tokenizer thread
            ids = tokenize_request(decode_json(raw), m.served_names(), limits.max_prompt_chars)(m.tokenizer)
            return json.dumps({"count": len(ids), "max_model_len": m.max_model_len, "tokens": ids})

        return await self._tokenizer_call(request, job)

    async def detokenize(self, request: web.Request) -> web.Response:
        m = self.service.model

        def job(raw: bytes) -> str:
            ids = detokenize_request(decode_json(raw), m.served_names(), m.config.vocab_size, m.max_model_len)
            return json.dumps({"prompt": m.tokenizer.decode(ids)})

        # No body longer than this holds max_model_len token ids (each at most 10 digits and ", ").
        return await self._tokenizer_call(request, job, (m.max_model_len * 12 + 1024, "detokenize_max_bytes"))

    async def _tokenizer_call(self, request: web.Request, job, limit: tuple[int | None, str] = (None, "")) -> web.Response:
        """``job(body)`` -> JSON text, run as a request admitted to the tokenizer queue."""
        try:
            body = await self._raw(request, *limit)
            tenant = self.service.tenant_of(request.headers.get("Authorization"))
            return web.json_response(text=await self.service.client_job(job, body, tenant=tenant))
        except (HttpError, InvalidRequestError, RouteError) as exc:
            return self._error(exc)

    async def version(self, request: web.Request) -> web.Response:
        try:
            version = importlib.metadata.version("pdserve")
        except importlib.metadata.PackageNotFoundError:  # run from a source tree
            version = "unknown"
        return web.json_response({"version": version})

    async def health(self, request: web.Request) -> web.Response:
        if self.service.draining or self.service.unready:
            return error_response(503, "the router is shutting down", "service_unavailable")
        pool = self.service.pool
        if pool.ready():
            degraded = pool.degraded()  # no prefill worker: the decode workers prefill meanwhile
            return web.json_response({"status": "degraded", "missing": degraded} if degraded else {"status": "ok"})
        return error_response(503, " and ".join(f"no ready {role} worker" for role in pool.missing_roles()),
                              "service_unavailable")

    async def metrics(self, request: web.Request) -> web.Response:
        from pdserve.wire import metrics

        body, content_type = metrics.render()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def metrics_targets(self, request: web.Request) -> web.Response:
        return web.json_response(self.service.pool.metrics_targets())


async def _pump(choice: Choice, stream: AsyncIterator, queue: asyncio.Queue) -> None:
    """Every response of one choice's stream into ``queue`` as (choice, response), then
    (choice, None); an error the client is told of ends it as (choice, error)."""
    try:
        async for resp in stream:
            await queue.put((choice, resp))
        await queue.put((choice, None))
    except (InvalidRequestError, RouteError, HttpError) as exc:
        await queue.put((choice, exc))


async def _items(early: list, queue: asyncio.Queue, num_choices: int):
    """(choice, response or error) in arrival order, ``early`` first, until every choice's
    stream has ended (a choice's end marker is not yielded)."""
    ended = 0
    pending = list(early)
    while ended < num_choices:
        choice, item = pending.pop(0) if pending else await queue.get()
        if item is None:
            ended += 1
            continue
        yield choice, item
        if isinstance(item, Exception):
            return


@web.middleware
async def _echo_request_id(request: web.Request, handler):
    """A client's X-Request-Id comes back on the answer (streams set it themselves, since
    their headers are sent before the handler returns)."""
    response = await handler(request)
    value = request.headers.get(REQUEST_ID_HEADER)
    if value is not None and not response.prepared:
        response.headers[REQUEST_ID_HEADER] = value
    return response


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


async def _send(response: web.StreamResponse, payload: dict[str, Any], idle_s: float) -> None:
    await _write(response, f"data: {json.dumps(payload)}\n\n".encode(), idle_s)


async def _write(response: web.StreamResponse, data: bytes, idle_s: float) -> None:
    """One write of a stream; a client that takes none of it for ``idle_s`` is dropped (the
    handler ends, which aborts its request on the workers)."""
    try:
        await asyncio.wait_for(response.write(data), idle_s)
    except TimeoutError:
        raise ConnectionResetError(f"the client read nothing for stream_idle_timeout_s={idle_s:g}") from None


async def start(service: GenerationService, host: str | Endpoint, port: int, *, tls: TlsConfig | None = None,
                admin: LoRAAdmin | None = None) -> tuple[web.AppRunner, str]:
    """Serve the front on ``host:port`` (0: any free port), behind the service's API keys
    (``pdserve.router.auth``) and over HTTPS with ``tls``; returns the runner and the advertised address."""
    endpoint = host if isinstance(host, Endpoint) else resolve(host)
    app = OpenAIFront(service, admin).app()
    if service.keys is not None:
        app.middlewares.append(auth.http_middleware(service.keys))
    # handler_cancellation: a client that disconnects cancels its handler (aiohttp's default
    # since 3.9 is to let it run on), so its request stops using the workers at once.
    # keepalive_timeout: aiohttp closes a connection that has not completed a request's
    # headers this long after it opened (or after its last answer): the header timeout.
    runner = web.AppRunner(app, access_log=ACCESS_LOGGER, access_log_format=ACCESS_FORMAT, handler_cancellation=True,
                           keepalive_timeout=service.limits.http_header_timeout_s)
    await runner.setup()
    # reuse_port: a rolling restart's next router binds the same port while this one still
    # serves (gRPC's own servers set SO_REUSEPORT already); pdserve.router.handover.
    site = web.TCPSite(runner, endpoint.bind_host, port, ssl_context=tls.http_server_context() if tls else None,
                       reuse_port=True)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # aiohttp exposes no public accessor for port 0
    return runner, endpoint.advertise(bound)
