"""One request's path through the cluster: prefill, stream the first token, decode, and
recover from worker faults by re-prefilling prompt + tokens already sent. Each run records
its request's metrics (``pdserve.wire.metrics.RequestMetrics``) as it goes.

Time: a request has one deadline (``timeout_s``, the client's or ``request_timeout_s``) that
bounds every RPC it makes, and one admission budget (``admission_wait_s``) shared by every
wait for room before its first token. RESOURCE_EXHAUSTED (HTTP 429) is only ever answered
before the first token: later, a request that cannot go on ends UNAVAILABLE or
DEADLINE_EXCEEDED."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import grpc

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.grammar import resumed
from pdserve.engine.tokenizer import IncrementalDetokenizer
from pdserve.protos import pdserve_pb2, worker_pb2
from pdserve.router.frontend import ModelInfo, PreparedRequest
from pdserve.router.limits import RouterLimits
from pdserve.router.local_prefill import decide
from pdserve.router.policy import Choice, pick_decode
from pdserve.router.pool import WorkerPool
from pdserve.router.worker_calls import Started, detach, error_field, ignore_errors, last_message, unavailable, unless_hung
from pdserve.wire.convert import DEFAULT_MAX_TOKENS, finish_from_wire, finish_to_wire, sampling_to_proto
from pdserve.kv_transfer.handoff import ReleaseReason, release_request
from pdserve.wire.failure import Failure, failure_of
from pdserve.wire.metrics import RequestMetrics

log = logging.getLogger(__name__)

# A worker that cannot be reached: try another. Anything else is the request's own fault.
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL,
              grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED}


class RouteError(Exception):
    """The request cannot be served; ``code`` is the gRPC status the client gets."""

    def __init__(self, code: grpc.StatusCode, message: str):
        self.code = code
        super().__init__(message)


class _DecodeLost(Exception):
    """The decode side failed (transfer failed, worker died): re-prefill and continue."""


@dataclass
class Progress:
    """What the client has been sent so far."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    cached_tokens: int = 0
    kv_bytes: int = 0
    kv_seconds: float = 0.0
    migrations: int = 0
    admission_wait_s: float = 0.0  # time spent waiting in the router for room in a full pool
    first_token_at: float | None = None


class RequestRun:
    """One request through prefill and decode. ``arrived`` (``time.monotonic()``) is when it
    reached the router, before tokenization: its latencies count from there."""

    def __init__(self, req: PreparedRequest, model: ModelInfo, pool: WorkerPool, limits: RouterLimits,
                 arrived: float | None = None, timeout_s: float | None = None):
        self.req = req
        self.model = model
        self.pool = pool
        self.limits = limits
        self.arrived = arrived if arrived is not None else time.monotonic()  # the loop's clock (monotonic)
        self.timeout_s = timeout_s if timeout_s is not None else limits.request_timeout_s
        self.progress = Progress()
        self.metrics = RequestMetrics(arrived=arrived, model_name=model.name)
        self._detok = IncrementalDetokenizer(model.tokenizer, req.params.stop)

    async def responses(self) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
        """The client's stream. The request is counted however it ends: finished, failed, or
        cancelled (``Abort``, or the client gone)."""
        try:
            async with contextlib.aclosing(self._attempts()) as stream:
                async for resp in stream:
                    yield resp
        except (asyncio.CancelledError, GeneratorExit):
            # Ignored when the last response was already sent (a caller may close the stream
            # once it has it): the request counted as finished then.
            self.metrics.finished("abort")
            raise
        except Exception as exc:
            exc = self._after_first_token(exc)
            self.metrics.failed(_failure_code(exc))
            raise exc

    def _after_first_token(self, exc: Exception) -> Exception:
        """A full pool is a 429 only before the first token; a client that already has tokens
        must not be told to retry the request (and perhaps repeat its side effects)."""
        if (isinstance(exc, RouteError) and exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                and self.progress.token_ids):
            return RouteError(grpc.StatusCode.UNAVAILABLE, f"{exc} (after {len(self.progress.token_ids)} tokens)")
        return exc

    # ---- time ------------------------------------------------------------------------
    @property
    def deadline(self) -> float:
        return self.arrived + self.timeout_s

    def remaining_s(self) -> float:
        """Seconds until the request's deadline; raises DEADLINE_EXCEEDED once it has passed."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise RouteError(grpc.StatusCode.DEADLINE_EXCEEDED,
                             f"the request's deadline of {self.timeout_s:g} s passed "
                             f"(after {len(self.progress.token_ids)} tokens)")
        return left

    async def _attempts(self) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
        attempt = 0
        while True:
            prompt = self.req.prompt_token_ids + self.progress.token_ids
            sent = len(self.progress.token_ids)
            # A re-prefill after a lost decode continues the output: the prompt logprobs went
            # out with the first token, and min_tokens counts what was already sent.
            params = dataclasses.replace(self.req.params, stop=(), max_tokens=self.req.params.max_tokens - sent,
                                         min_tokens=max(0, self.req.params.min_tokens - sent),
                                         prompt_logprobs=self.req.params.prompt_logprobs if not sent else None,
                                         structured=resumed(self.req.params.structured, sent))
            worker_rid = attempt_id(self.req.request_id, attempt)
            blocks = await self._check_decode_capacity(len(prompt) + self._reserved(params))  # before any prefill work
            lease = None  # (prefill worker, token) of KV held for us that no decode worker took yet
            decoding = None  # streamed KV: the decode stream, started before the prefill answered
            try:
                if self._prefill_locally(len(prompt), blocks):
                    stream = self._decode(worker_rid, prompt, None, params)
                else:
                    pre, prefill_addr, streaming = await self._prefill(worker_rid, prompt, params)
                    if pre.HasField("kv"):
                        lease = (prefill_addr, pre.kv.lease_token)
                    if streaming is not None:  # the KV streams to a decode worker picked now
                        decoding = Started(self._decode(worker_rid, prompt, pre, params))
                        pre = await self._streamed_answer(streaming, prefill_addr, decoding)
                    if attempt == 0:
                        self._note_prefilled(len(prompt), pre.num_cached_tokens, pre.queue_seconds,
                                             pre.prefill_seconds)
                    first = self._emit([pre.first_token_id], [pre.first_logprob] if params.logprobs else [],
                                       finish_from_wire(pre.finish_reason),
                                       [pre.first_top_logprobs] if params.top_logprobs else [])
                    yield self._with_prompt_logprobs(first, params, pre)
                    if self.progress.finish_reason is not None:
                        return
                    stream = decoding.stream() if decoding is not None else self._decode(worker_rid, prompt, pre, params)
                async for resp in stream:
                    lease = None  # the decode worker took over the lease
                    yield resp
                    if self.progress.finish_reason is not None:
                        return
                raise _DecodeLost("decode stream ended without a finish reason")
            except _DecodeLost as exc:
                attempt += 1
                self.progress.migrations += 1
                log.warning("request %s: %s; re-prefilling %d tokens", self.req.request_id, exc, len(prompt) + 1)
                if self.progress.migrations > self.limits.max_migrations:
                    raise RouteError(grpc.StatusCode.UNAVAILABLE, f"gave up after {self.progress.migrations - 1} "
                                     f"migrations: {exc}") from exc
                self.metrics.migrated()
            finally:
                if decoding is not None:
                    await decoding.close()
                if lease is not None:
                    self._release_later(*lease)

    def _note_prefilled(self, prompt_tokens: int, cached_tokens: int, queue_s: float, prefill_s: float) -> None:
        """The request's first prefill answered (on a prefill worker, or its decode worker)."""
        self.progress.cached_tokens = cached_tokens
        self.progress.first_token_at = asyncio.get_running_loop().time()
        self.metrics.prefilled(prompt_tokens, queue_s, prefill_s, admission_s=self.progress.admission_wait_s)

    def _with_prompt_logprobs(self, first: pdserve_pb2.GenerateResponse, params,
                              answer) -> pdserve_pb2.GenerateResponse:
        """``first`` (an attempt's first token) with the prompt logprobs, if asked for, from
        ``answer``: a PrefillResponse, or a locally prefilled DecodeResponse."""
        if params.prompt_logprobs is not None:
            first.prompt_token_ids.extend(self.req.prompt_token_ids)
            first.prompt_logprobs.extend(answer.prompt_logprobs)
            first.prompt_top_logprobs.extend(answer.prompt_top_logprobs)
        return first

    def _prefill_locally(self, prompt_tokens: int, blocks: int) -> bool:
        """The local-prefill rule (pdserve/router/local_prefill.py) for this attempt, on the decode
        worker ``_decode`` will pick first (the same pick over the same snapshots, with no
        await between), recorded in the metrics."""
        snapshots = self.pool.snapshots()
        choice = pick_decode(snapshots, blocks, limited=not self.req.default_max_tokens)
        worker = next((w for w in snapshots if w.worker_id == choice.worker_id), None)
        load = min(1.0, worker.blocks_used / max(worker.blocks_total, 1)) if worker is not None else 1.0
        decision = decide(self.limits.local_prefill, prompt_tokens, load)
        self.metrics.prefill_placed(decision.label, decision.reason.value, decision.uncached_tokens, decision.load)
        return decision.local

    def _reserved(self, params) -> int:
        """Output tokens to count on a decode worker: max_tokens, unless the client left it
        to default to the rest of the context; then a short answer's worth, or every such
        request would claim a whole context and one request could fill a worker. What it
        grows past that is taken back first: the decode engine preempts the sequence that may
        still grow the most (pdserve/engine/scheduler.py), so such requests cannot push out limited
        ones however far they run."""
        if self.req.default_max_tokens:
            return min(params.max_tokens, DEFAULT_MAX_TOKENS)
        return params.max_tokens

    async def _check_decode_capacity(self, total_tokens: int) -> int:
        """Wait for a decode worker with room for ``total_tokens``; returns their blocks."""
        blocks = -(-total_tokens // self.model.block_size)
        choice = await self._admit(lambda: pick_decode(self.pool.snapshots(), blocks,
                                                       limited=not self.req.default_max_tokens))
        if choice.worker_id is None:
            raise _route_error(choice)
        return blocks

    async def _admit(self, pick: Callable[[], Choice]) -> Choice:
        """``pick()``, re-tried while its pool is saturated or has no routable worker at all (a
        replacement is on its way: with one decode worker, a crash would otherwise fail every
        stream in flight): before the first token until the request's admission budget is
        spent, after it until the request's deadline."""
        start = time.monotonic()
        if self.progress.token_ids:
            deadline = self.deadline
        else:
            deadline = min(self.deadline, self.arrived + self.limits.admission_wait_s)
        try:
            while True:
                choice = pick()
                if choice.worker_id is not None or not (choice.saturated or choice.pool_empty):
                    return choice
                if time.monotonic() >= deadline:
                    self.remaining_s()  # DEADLINE_EXCEEDED if it was the request's own deadline
                    return choice
                await asyncio.sleep(min(self.pool.interval_s, max(deadline - time.monotonic(), 0.0)))
        finally:
            self.progress.admission_wait_s += time.monotonic() - start

    # ---- prefill -------------------------------------------------------------------
    async def _prefill(self, worker_rid: str, prompt: list[int], params):
        """(the prefill worker's answer, its address, None); with streamed KV, the answer may
        be the early KV handle (``kv_streaming``), and then the third is the open call, whose
        last message is the answer (``_streamed_answer``)."""
        request = worker_pb2.PrefillRequest(request_id=worker_rid, prompt_token_ids=prompt,
                                            sampling=sampling_to_proto(params), router_id=self.pool.router_id)
        stream_kv = 0 < self.limits.stream_kv_min_tokens <= len(prompt)
        tried: set[str] = set()
        last = "no prefill worker"
        for _ in range(self.limits.max_prefill_attempts):
            choice = await self._admit(lambda: self.pool.route_prefill(
                prompt, self.limits.routing, frozenset(tried), self.limits.max_queued_tokens_per_prefill,
                params.cache_salt))
            if choice.worker_id is None:
                if choice.saturated:
                    raise _route_error(choice)
                break
            client = self.pool.workers[choice.worker_id]
            tried.add(client.address)
            self.metrics.routed(choice.rule, choice.cached_tokens)
            try:
                with self.pool.placed(client, tokens=len(prompt) - choice.cached_tokens):
                    if not stream_kv:
                        call = client.stub.Prefill(request, timeout=self.remaining_s())
                        return await unless_hung(call, client), client.address, None
                    call = client.stub.PrefillStream(request, timeout=self.remaining_s())
                    first = await unless_hung(call.read(), client, call)
                    if first is grpc.aio.EOF:
                        raise unavailable(f"prefill worker {client.address} ended the stream without an answer")
                    return first, client.address, (call if first.kv_streaming else None)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise InvalidRequestError(error_field(exc), exc.details()) from exc
                self.remaining_s()  # our own deadline passed: not the worker's fault
                _raise_if_step_failed(exc)
                if exc.code() not in _RETRYABLE | {grpc.StatusCode.RESOURCE_EXHAUSTED}:
                    raise
                last = f"prefill worker {client.address}: {exc.code().name} {exc.details()}"
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    self.pool.mark_down(client.address)
                self.metrics.retried()
                log.warning("request %s: %s; trying another", self.req.request_id, last)
        code = grpc.StatusCode.RESOURCE_EXHAUSTED if "RESOURCE_EXHAUSTED" in last else grpc.StatusCode.UNAVAILABLE
        raise RouteError(code, f"no prefill worker could take the request ({last})")

    async def _streamed_answer(self, call, address: str, decoding: Started) -> worker_pb2.PrefillResponse:
        """The answer of a PrefillStream whose KV is streaming to ``decoding`` meanwhile. A
        failure of either side before the answer loses this attempt (re-prefill), as a
        failed transfer does; a decode side that failed first cancels the prefill."""
        client = self.pool.workers.get(address)
        answer = asyncio.ensure_future(last_message(call))
        try:
            while not answer.done():
                waits = {answer} | ({decoding.first} if not decoding.first.done() else set())
                lost = asyncio.ensure_future(client.lost.wait()) if client is not None else None
                try:
                    await asyncio.wait(waits | ({lost} if lost else set()), timeout=self.remaining_s(),
                                       return_when=asyncio.FIRST_COMPLETED)
                finally:
                    if lost is not None:
                        lost.cancel()
                self.remaining_s()
                if decoding.first.done() and decoding.first.exception() is not None:
                    raise decoding.first.exception()
                if lost is not None and lost.done() and not answer.done():
                    raise _DecodeLost(f"prefill worker {address} is hung (no engine progress, hang_timeout_s)")
            return answer.result()
        except grpc.aio.AioRpcError as exc:
            self.remaining_s()
            _raise_if_step_failed(exc)
            if failure_of(exc) is not Failure.KV_TRANSFER:
                self.pool.mark_down(address)
            raise _DecodeLost(f"prefill worker {address} while the KV streamed: {exc.code().name} "
                              f"{exc.details()}") from exc
        finally:
            if not answer.done():
                answer.cancel()
                call.cancel()

    # ---- decode --------------------------------------------------------------------
    async def _decode(self, worker_rid: str, prompt: list[int], pre: worker_pb2.PrefillResponse | None, params):
        """The decode stream, on the first decode worker that takes it. ``pre`` None: that
        worker prefills the prompt itself, and its first response carries the first token."""
        if pre is None:
            request = worker_pb2.DecodeRequest(request_id=worker_rid, prompt_token_ids=prompt,
                                               sampling=sampling_to_proto(params), local_prefill=True)
        else:
            request = worker_pb2.DecodeRequest(request_id=worker_rid, prompt_token_ids=prompt,
                                               first_token_id=pre.first_token_id, sampling=sampling_to_proto(params),
                                               kv=pre.kv, kv_streamed=pre.kv_streaming)
        blocks = -(-(len(prompt) + self._reserved(params)) // self.model.block_size)
        tried: set[str] = set()
        while True:
            choice = await self._admit(lambda: pick_decode(self.pool.snapshots(), blocks, frozenset(tried),
                                                           limited=not self.req.default_max_tokens))
            if choice.worker_id is None:
                if tried and not choice.saturated:
                    raise _DecodeLost(choice.reason)
                raise _route_error(choice)
            client = self.pool.workers[choice.worker_id]
            tried.add(client.address)
            call = client.stub.Decode(request, timeout=self.remaining_s())
            started = tokens_seen = False
            try:
                with self.pool.placed(client, blocks=blocks):
                    async with contextlib.aclosing(self._idle_bounded(call, client)) as messages:
                        async for resp in messages:
                            started = True
                            if resp.kv_progress:  # streamed KV: more of it read while prefill goes on
                                continue
                            if resp.kv_bytes:  # the KV-arrived notice, not output
                                self.pool.transfer_ok(pre.kv.prefill_address)
                                self.progress.kv_bytes += resp.kv_bytes
                                self.progress.kv_seconds += resp.kv_transfer_seconds
                                self.metrics.kv_transferred(resp.kv_transfer_seconds)
                                continue
                            if pre is None and not tokens_seen:
                                tokens_seen = True
                                yield self._locally_prefilled(resp, len(prompt), params)
                                if self.progress.finish_reason is not None:
                                    return
                                continue
                            yield self._emit(list(resp.token_ids), list(resp.logprobs),
                                             finish_from_wire(resp.finish_reason), list(resp.top_logprobs))
                            if self.progress.finish_reason is not None:
                                return
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise InvalidRequestError(error_field(exc), exc.details()) from exc
                self.remaining_s()  # our own deadline passed: not the worker's fault
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and not started:
                    continue  # the KV is still held: another decode worker may take it
                _raise_if_step_failed(exc)
                if failure_of(exc) is not Failure.KV_TRANSFER:
                    self.pool.mark_down(client.address)  # the decode worker itself failed
                elif pre is not None:
                    self.pool.transfer_failed(pre.kv.prefill_address)  # its source, if it keeps failing
                raise _DecodeLost(f"decode worker {client.address}: {exc.code().name} {exc.details()}") from exc
            finally:
                call.cancel()

    def _locally_prefilled(self, resp: worker_pb2.DecodeResponse, prompt_tokens: int,
                           params) -> pdserve_pb2.GenerateResponse:
        """The first response of a locally prefilled stream, sent as a prefill answer's is."""
        if self.progress.first_token_at is None:
            self._note_prefilled(prompt_tokens, resp.num_cached_tokens, 0.0, resp.prefill_seconds)
        first = self._emit(list(resp.token_ids), list(resp.logprobs), finish_from_wire(resp.finish_reason),
                           list(resp.top_logprobs))
        return self._with_prompt_logprobs(first, params, resp)

    async def _idle_bounded(self, call, client):
        """``call``'s messages; a gap longer than ``decode_idle_timeout_s`` is a lost decode,
        and so is the worker found hung meanwhile (``pdserve.router.liveness``, usually much sooner);
        a gap that reaches the request's deadline is DEADLINE_EXCEEDED."""
        messages = aiter(call)
        while True:
            idle_s = min(self.limits.decode_idle_timeout_s, self.remaining_s())
            following = asyncio.ensure_future(anext(messages))
            hung = asyncio.ensure_future(client.lost.wait())
            try:
                done, _ = await asyncio.wait({following, hung}, timeout=idle_s, return_when=asyncio.FIRST_COMPLETED)
            finally:
                hung.cancel()
                if not following.done():
                    following.cancel()
            if following in done:
                try:
                    resp = following.result()
                except StopAsyncIteration:
                    return
                yield resp
                continue
            if hung in done:
                raise _DecodeLost(f"decode worker {client.address} is hung (no engine progress for "
                                  f"{self.pool.hang_timeout_s:g} s, hang_timeout_s)")
            self.remaining_s()
            raise _DecodeLost(f"decode worker {client.address} sent nothing for {idle_s:g} s "
                              f"(decode_idle_timeout_s)")

    # ---- output --------------------------------------------------------------------
    def _emit(self, token_ids: list[int], logprobs: list[float], finish: str | None,
              top_logprobs: list[pdserve_pb2.TopLogprobs] = ()) -> pdserve_pb2.GenerateResponse:
        text = []
        for t in token_ids:
            self.progress.token_ids.append(t)
            delta, hit_stop = self._detok.add(t)
            text.append(delta)
            if hit_stop:
                finish = "stop"
                break
        kept = len(text)
        if finish is not None:
            self.progress.finish_reason = finish
            text.append(self._detok.flush())  # text held back while a stop string could still match
        resp = pdserve_pb2.GenerateResponse(request_id=self.req.request_id, token_ids=token_ids[:kept],
                                            text="".join(text), logprobs=logprobs[:kept],
                                            top_logprobs=list(top_logprobs)[:kept],
                                            finish_reason=finish_to_wire(finish))
        if finish is not None:
            resp.usage.CopyFrom(self.usage())
        self.metrics.sent(kept, finish)
        return resp

    def usage(self) -> pdserve_pb2.Usage:
        return pdserve_pb2.Usage(prompt_tokens=len(self.req.prompt_token_ids),
                                 completion_tokens=len(self.progress.token_ids),
                                 cached_prompt_tokens=self.progress.cached_tokens)

    def _release_later(self, address: str, lease_token: str) -> None:
        """Free a lease the decode side never took (best effort; the lease expires anyway)."""
        client = self.pool.workers.get(address)
        if client is None:
            return
        release = client.stub.Release(release_request(lease_token, ReleaseReason.ABORTED), timeout=5)
        detach(ignore_errors(release))


def attempt_id(request_id: str, attempt: int) -> str:
    """The id the workers know one attempt of a request by: the client's id and the attempt
    number (for logs), then 16 random bytes that only the router and the workers of this
    attempt learn. Workers key the engine's sequence, the stream and ``Abort`` on it, so an
    ``Abort`` or a second ``Decode`` naming a client's request id (clients choose ids), or
    another router's request of the same id, reaches nothing of this attempt."""
    return f"{request_id}#{attempt}.{secrets.token_urlsafe(16)}"


def _route_error(choice) -> Exception:
    if choice.too_large:
        return InvalidRequestError("max_tokens", choice.reason)
    code = grpc.StatusCode.RESOURCE_EXHAUSTED if choice.saturated else grpc.StatusCode.UNAVAILABLE
    return RouteError(code, choice.reason)


def _failure_code(exc: Exception) -> str:
    """The gRPC status name a failed request ends with, for the failure counter."""
    if isinstance(exc, RouteError):
        return exc.code.name
    if isinstance(exc, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT.name
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code().name
    return grpc.StatusCode.INTERNAL.name


def _raise_if_step_failed(exc: grpc.aio.AioRpcError) -> None:
    """A step that raised aborted this request on a healthy worker: retrying it elsewhere
    would repeat the failure, so the client gets it (ABORTED) and the worker stays up."""
    if failure_of(exc) is Failure.STEP_FAILED:
        raise RouteError(grpc.StatusCode.ABORTED, exc.details() or "engine step failed") from exc
