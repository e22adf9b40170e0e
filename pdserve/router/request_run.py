"""One request's life in the router: attempts until the output is complete, recovering from
worker faults by re-prefilling prompt + tokens already sent on a healthy pair (a migration),
or, when no prefill worker answers (hung, dead, being replaced), by prefilling on a decode
worker, within the request's deadline and admission budget (``pdserve.router.request_budget``). A
stream a decode worker hands over with its KV goes on from that KV on another decode worker
instead (``MovedKV``).

Each attempt is of one kind (``pdserve.router.attempts``): its prefill answer and decode
outputs go through the request's ``OutputProcessor`` to the client. Each run records its
request's metrics (``pdserve.wire.metrics.RequestMetrics``) as it goes."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import AsyncIterator

import grpc

from pdserve.protos import pdserve_pb2, worker_pb2
from pdserve.router.attempts import (Attempt, LocalPrefill, MovedKV, Output, RemotePrefill, attempt_id, attempt_params,
                                     moved_params, release_later)
from pdserve.router.errors import AttemptLost, NoPrefillWorker, RouteError, failure_code, route_error
from pdserve.router.frontend import ModelInfo, PreparedRequest
from pdserve.router.limits import RouterLimits
from pdserve.router.local_prefill import (Decision, Mixed, Reason, beyond_prefill, decide_for_attempt, find_holder,
                                         prefill_options, worker_load)
from pdserve.router.output_processor import OutputProcessor
from pdserve.router.policy import WorkerSnapshot, avoiding, pick_decode, verify_agrees
from pdserve.router.pool import WorkerPool
from pdserve.router.request_budget import RequestBudget
from pdserve.router.request_spans import RequestSpans
from pdserve.router.worker_calls import CallContext
from pdserve.wire.convert import DEFAULT_MAX_TOKENS, finish_from_wire, sampling_to_proto
from pdserve.wire.metrics import RequestMetrics

log = logging.getLogger(__name__)


class RequestRun:
    """One request through prefill and decode. ``arrived`` (``time.monotonic()``) is when it
    reached the router, before tokenization: its latencies count from there. ``spans``: the
    request's trace (``pdserve.router.request_spans``); None while tracing is off.
    ``session_id``: the client's optional session hint (``pdserve.router.session_hint``)."""

    def __init__(self, req: PreparedRequest, model: ModelInfo, pool: WorkerPool, limits: RouterLimits,
                 arrived: float | None = None, timeout_s: float | None = None, spans: RequestSpans | None = None,
                 session_id: str | None = None):
        self.req = req
        # Keyed within the request's KV salt (its tenant's, its own, its LoRA adapter's): one
        # tenant's session ids never steer another's requests, nor one adapter's another's.
        self.session_key = f"{pool.kv_salt(req.params)}\0{session_id}" if session_id else None
        self.model = model
        self.pool = pool
        self.limits = limits
        arrived = arrived if arrived is not None else time.monotonic()
        self.output = OutputProcessor(req.request_id, req.prompt_token_ids, req.params, model.tokenizer)
        self.budget = RequestBudget(arrived, timeout_s if timeout_s is not None else limits.request_timeout_s,
                                    limits.admission_wait_s, sent=lambda: len(self.output.token_ids))
        self.metrics = RequestMetrics(arrived=arrived, model_name=model.name)
        self.calls = CallContext(req.request_id, pool, limits, self.budget, self.metrics,
                                 limited=not req.default_max_tokens, spans=spans, lora_name=req.params.lora_name)
        self.migrations = 0
        self._prefilled = False  # the request's first prefill answer came
        self._local_next = False  # the last attempt was lost to a local prefill (AttemptLost.local)

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
            self.metrics.failed(failure_code(exc))
            raise exc

    def usage(self) -> pdserve_pb2.Usage:
        return self.output.usage()

    def _after_first_token(self, exc: Exception) -> Exception:
        """A full pool is a 429 only before the first token; a client that already has tokens
        must not be told to retry the request (and perhaps repeat its side effects)."""
        if (isinstance(exc, RouteError) and exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                and self.output.token_ids):
            return RouteError(grpc.StatusCode.UNAVAILABLE, f"{exc} (after {len(self.output.token_ids)} tokens)")
        return exc

    async def _attempts(self) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
        number, moved, local = 0, None, False
        while True:
            attempt = self._attempt(number, moved is not None)
            try:
                await self._check_decode_capacity(attempt.blocks)  # before any prefill work
            except BaseException:  # no room in time, or the client left: moved KV is freed now
                if moved is not None:
                    release_later(self.calls, moved.prefill_address, moved.lease_token)
                raise
            if moved is not None:
                kind = MovedKV(moved, self.output.token_ids[-1])
            elif local:
                kind, local = LocalPrefill(), False
            else:
                kind, attempt = self._plan(attempt)
            spans = self.calls.spans
            if spans is not None:
                spans.start_attempt(number, kind.label, len(attempt.prompt))
            try:
                async with contextlib.aclosing(kind.outputs(self.calls, attempt)) as outputs:
                    async for out in outputs:
                        yield self._process(out, attempt, remote=kind.label == "remote")
                        if self.output.finished:
                            if spans is not None:
                                spans.end_attempt()
                            self._expect_cached()
                            return
                raise AttemptLost("decode stream ended without a finish reason")
            except NoPrefillWorker as exc:  # raised before the attempt sent anything
                if spans is not None:
                    spans.end_attempt(lost=exc)
                number, local = number + 1, True
                self._prefill_pool_lost(exc, attempt)
            except AttemptLost as exc:
                if spans is not None:
                    spans.end_attempt(lost=exc)
                number += 1
                moved, self._local_next = self._movable(exc.moved), exc.local
                self._migrate(exc, attempt, moved)

    def _prefill_pool_lost(self, exc: NoPrefillWorker, attempt: Attempt) -> None:
        """No prefill worker answered: the next attempt prefills on a decode worker, which can,
        rather than the request failing while the prefill pool is hung, empty or replaced. Not
        a migration: nothing of the attempt went out, and no worker holds anything of it."""
        log.warning("request %s: %s; a decode worker prefills it", self.req.request_id, exc)
        self.metrics.prefill_placed("local", Reason.NO_PREFILL_WORKER.value, len(attempt.prompt), 0.0)

    def _attempt(self, number: int, moved: bool = False) -> Attempt:
        """The next attempt: the prompt with the output sent so far, and the rest to make.
        ``moved``: it goes on from moved KV, which holds all of that but the last token sent."""
        sent = self.output.token_ids
        params = moved_params(self.req.params, len(sent)) if moved else attempt_params(self.req.params, len(sent))
        prompt = self.req.prompt_token_ids + (sent[:-1] if moved else sent)
        blocks = -(-(len(prompt) + self._reserved(params.max_tokens)) // self.model.block_size)
        return Attempt(attempt_id(self.req.request_id, number), prompt, sampling_to_proto(params), blocks)

    def _reserved(self, max_tokens: int) -> int:
        """Output tokens to count on a decode worker: max_tokens, unless the client left it
        to default to the rest of the context; then a short answer's worth, or every such
        request would claim a whole context and one request could fill a worker. What it
        grows past that is taken back first: the decode engine preempts the sequence that may
        still grow the most (pdserve/engine/core/scheduler.py), so such requests cannot push out limited
        ones however far they run."""
        if self.req.default_max_tokens:
            return min(max_tokens, DEFAULT_MAX_TOKENS)
        return max_tokens

    async def _check_decode_capacity(self, blocks: int) -> None:
        """Wait for a decode worker with room for ``blocks``."""
        choice = await self.budget.admit(lambda: pick_decode(self.pool.snapshots(self.calls.lora_name), blocks, limited=self.calls.limited),
                                         self.pool.interval_s)
        if choice.worker_id is None:
            raise route_error(choice)

    def _plan(self, attempt: Attempt) -> tuple[LocalPrefill | RemotePrefill, Attempt]:
        """This attempt's kind, by the local-prefill rules (pdserve/router/local_prefill.py),
        and the attempt with the decode worker the plan is for, recorded in the metrics. With
        no decode worker caching a prefix, the rule runs on the decode worker the decode call
        will pick first (the same pick over the same snapshots, with no await between), or on
        the one the session hint names. A remote plan needs a prefill worker that verifies KV
        as that decode worker does (``_verify_agreed``); with none, or after a lost attempt that
        asked for it (``AttemptLost.local``: its reader refused KV without checksums), the decode
        worker prefills it."""
        snapshots = self.pool.snapshots(self.calls.lora_name)
        salt = self.pool.kv_salt(attempt.sampling)  # the adapter folded in: the index never matches another's blocks
        holder, prefills = None, []
        if self.limits.decode_kv_reuse:
            overlaps = {w: tokens for w, tokens in self.pool.decode_overlaps(attempt.prompt, salt).items()
                        if w not in self.calls.avoid}  # a failed transfer's reader is no holder to go back to
            holder = find_holder(snapshots, overlaps, attempt.blocks, limited=self.calls.limited)
            if holder is not None:
                prefills = prefill_options(snapshots, self.pool.prefill_overlaps(attempt.prompt, salt))
                holder = beyond_prefill(holder, prefills)  # a prefix the prefill pool holds too: as before
        worker = self._hinted(snapshots, attempt.blocks) if holder is None else None
        hinted = worker is not None
        if worker is None and holder is None:
            choice = avoiding(lambda excluded: pick_decode(snapshots, attempt.blocks, excluded, limited=self.calls.limited),
                              frozenset(), self.calls.avoid)
            worker = next((w for w in snapshots if w.worker_id == choice.worker_id), None)
        load = worker_load(worker) if worker is not None else 1.0
        decision = decide_for_attempt(self.limits.local_prefill, self.limits.routing, len(attempt.prompt), load,
                                      holder, prefills, mixed=_mixed(snapshots, worker, self.pool.prefill_pace.token_s))
        planned = decision.decode_worker or (worker.worker_id if worker is not None else None)
        verify = next((w.verify_kv for w in snapshots if w.worker_id == planned), None)
        decision = _verify_agreed(decision, snapshots, verify, self._local_next, self.req.request_id)
        self.metrics.prefill_placed(decision.label, decision.reason.value, decision.uncached_tokens, decision.load)
        decode_worker = decision.decode_worker or (worker.worker_id if hinted else None)
        self._remember(decode_worker or (worker.worker_id if worker is not None else None))
        attempt = dataclasses.replace(attempt, decode_worker=decode_worker, verify_kv=verify)
        if decision.local:
            return LocalPrefill(), attempt
        return RemotePrefill(stream_kv=0 < self.limits.stream_kv_min_tokens <= len(attempt.prompt),
                             prefix_from=decision.prefix_from), attempt

    def _expect_cached(self) -> None:
        """Tell the KV index what the decode worker that finished this stream caches now: the
        prompt and every token sent but the last (never computed), as its next cache events
        will say. A conversation's next turn often comes within the poll that brings them
        (0.2 s); without this it would find only the blocks of the previous poll and be planned
        as a first turn. Advisory, as every index entry: a worker that lost them costs a miss."""
        if self.limits.decode_kv_reuse and self.calls.decode_workers:
            tokens = self.req.prompt_token_ids + self.output.token_ids[:-1]
            self.pool.index.expect(self.calls.decode_workers[-1], tokens, self.pool.kv_salt(self.req.params))

    def _hinted(self, snapshots: list[WorkerSnapshot], blocks: int) -> WorkerSnapshot | None:
        """The decode worker that served this request's session last (``session_id``), while
        it is routable and has room; None without a hint or with decode_kv_reuse off
        (router.session_hint)."""
        if not (self.session_key and self.limits.decode_kv_reuse):  # the reuse off: as if no hint came
            return None
        address = self.pool.sessions.get(self.session_key)
        if address is None:
            return None
        mine = [w for w in snapshots if w.worker_id == address]
        if pick_decode(mine, blocks, limited=self.calls.limited).worker_id is None:
            return None
        return mine[0]

    def _remember(self, decode_worker: str | None) -> None:
        """Remember the decode worker planned for this session's attempt (the decode call
        may still fall back to another; the next turn's tokens find that one in the index)."""
        if self.session_key and self.limits.decode_kv_reuse and decode_worker is not None:
            self.pool.sessions.remember(self.session_key, decode_worker)

    def _process(self, out: Output, attempt: Attempt, remote: bool) -> pdserve_pb2.GenerateResponse:
        """One worker output as the client's response, counted in the metrics."""
        if isinstance(out, worker_pb2.PrefillResponse):
            if not self._prefilled:
                self._prefilled = True
                self.metrics.prefilled(len(attempt.prompt), out.queue_seconds, out.prefill_seconds,
                                       admission_s=self.budget.waited_s)
                if remote:  # a prefill worker's answer, not a decode worker's local one
                    self.pool.prefill_pace.observe(len(attempt.prompt) - out.num_cached_tokens,
                                                   out.prefill_seconds - out.queue_seconds)
            resp = self.output.prefilled(out)
        else:
            resp = self.output.decoded(out)
        self.metrics.sent(len(resp.token_ids), finish_from_wire(resp.finish_reason))
        return resp

    def _movable(self, kv: worker_pb2.KVHandle | None) -> worker_pb2.KVHandle | None:
        """``kv``, if the stream can go on from it: it holds exactly the prompt and every token
        this run has, but the last. Otherwise its lease is released, and the run re-prefills."""
        if kv is None:
            return None
        sent = self.output.token_ids
        if sent and kv.num_tokens == len(self.req.prompt_token_ids) + len(sent) - 1:
            return kv
        log.warning("request %s: moved KV holds %d tokens, the stream has %d; re-prefilling", self.req.request_id,
                    kv.num_tokens, len(self.req.prompt_token_ids) + len(sent))
        release_later(self.calls, kv.prefill_address, kv.lease_token)
        return None

    def _migrate(self, lost: AttemptLost, attempt: Attempt, moved: worker_pb2.KVHandle | None) -> None:
        """After a lost attempt: count it, or give up past ``max_migrations``. A move with the
        KV (``moved``) is no fault and re-prefills nothing: it does not count towards the limit
        (each needs a role switch, which the controller's dwell time spaces out)."""
        if moved is not None:
            log.info("request %s: %s; going on from it elsewhere", self.req.request_id, lost)
            self.metrics.kv_moved()
            return
        self.migrations += 1
        self.budget.faulted = True  # a replacement of the pool it emptied is waited for until the deadline
        log.warning("request %s: %s; re-prefilling %d tokens", self.req.request_id, lost, len(attempt.prompt) + 1)
        if self.migrations > self.limits.max_migrations:
            raise RouteError(grpc.StatusCode.UNAVAILABLE,
                             f"gave up after {self.migrations - 1} migrations: {lost}") from lost
        self.metrics.migrated()


def _mixed(snapshots: list[WorkerSnapshot], worker: WorkerSnapshot | None, token_s: float | None) -> Mixed:
    """The queues' part of the local-prefill rule, for a stream on ``worker`` (``token_s``: a
    prompt token's cost on the prefill pool, as seen; ``worker``'s own, as it measured it)."""
    queues = [w.queued_tokens for w in snapshots if w.role == "prefill" and w.routable]
    return Mixed(worker=worker is not None and worker.role == "mixed", prefill_down=not queues,
                 own_queue=worker.queued_tokens if worker is not None else 0,
                 prefill_queue=min(queues) if queues else None,
                 any_mixed=any(w.role == "mixed" and w.routable for w in snapshots), token_s=token_s,
                 local_token_s=worker.local_token_s if worker is not None else None)


def _verify_agreed(decision: Decision, snapshots: list[WorkerSnapshot], verify: bool | None, refused: bool,
                   request_id: str) -> Decision:
    """``decision``, or a local prefill (``Reason.VERIFY_MISMATCH``, logged) where a remote one
    cannot pair: no routable prefill worker verifies KV as the planned decode worker does
    (``verify``; ``pdserve.router.policy.verify_agrees``), or ``refused`` (the last attempt's
    reader refused KV that came without checksums: the router's view of the settings is stale)."""
    if decision.local:
        return decision
    agreeing = [w for w in snapshots if w.role == "prefill" and w.routable and verify_agrees(w.verify_kv, verify)]
    if agreeing and not refused:
        return decision
    log.warning("request %s: %s; the decode worker prefills it", request_id,
                "its last reader refused KV without checksums" if refused else
                f"no prefill worker has verify_kv_transfers {'on' if verify else 'off'}, as its decode worker")
    return dataclasses.replace(decision, local=True, reason=Reason.VERIFY_MISMATCH, prefix_from=None)
