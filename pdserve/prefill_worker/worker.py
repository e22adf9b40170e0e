"""The prefill worker's core: the shared worker shell plus what only prefill has, one record
per request (``pdserve.prefill_worker.record``, removed by ``forget``), the leases on held KV
(``pdserve.kv_transfer.handoff``), and the progress of prompts whose KV streams out while they
compute (``prefill_stream``; its messages and watch are ``pdserve.prefill_worker.kv_stream``)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import AsyncIterator

from pdserve.engine.core.block_hashes import kv_salt
from pdserve.engine.lora.manager import fingerprint_of
from pdserve.engine.core.block_manager import prompt_block_hashes
from pdserve.engine.device import wait_for_writes
from pdserve.engine.errors import InvalidRequestError, SequenceFailed, StepFailed
from pdserve.engine.llm_engine import LLMEngine, RequestOutput
from pdserve.engine.sampling.params import SamplingParams
from pdserve.kv_transfer import KVTransferAgent
from pdserve.kv_transfer.rank_agents import RankAgents
from pdserve.wire.address import resolve, transfer_listen_opts
from pdserve.wire.internal_plane import check_bind
from pdserve.kv_transfer.handoff import KVHandle, Lease, LeaseTable, ReleaseReason
from pdserve.kv_transfer.lease_upkeep import OwnerClock, upkeep
from pdserve.prefill_worker.kv_stream import KVEarly, KVLeaseEnded, KVReady, KVWatch
from pdserve.prefill_worker.prefix_pull import MetricLabels, PrefixPulls
from pdserve.prefill_worker.config import PrefillWorkerConfig
from pdserve.prefill_worker.prefix_source import PrefixPeers, read_prefix
from pdserve.prefill_worker.record import PrefillResult, RequestRecord
from pdserve.protos import worker_pb2
from pdserve.shell.agents import worker_agents, worker_engine
from pdserve.shell.cache_events import CacheEventLog
from pdserve.shell.worker import WorkerShell
from pdserve.wire import tracing

# While KV is held, a decode worker's read can complete at any moment and its notification
# frees the blocks: the engine thread looks for notifications this often, and never when
# nothing is held (an idle worker sleeps).
NOTIFICATION_POLL_S = 0.005


class PrefillWorker(WorkerShell):
    role = "prefill"

    def __init__(self, config: PrefillWorkerConfig, engine: LLMEngine | None = None,
                 agent: KVTransferAgent | RankAgents | None = None, cache_log: CacheEventLog | None = None):
        """``engine``, ``agent`` and ``cache_log`` (its prefix-cache events): ones this worker
        shares with a decode worker in the same process (``pdserve.elastic_worker``); None: its own."""
        engine = engine or worker_engine(config.engine)
        endpoint = resolve(config.host, config.advertise_host)  # internal plane: bind + advertised host
        check_bind(endpoint.bind_host, config.tls, config.insecure_internal, "the prefill worker")  # before its KV listener
        if agent is None:
            agent = worker_agents(config.kv_transfer_backend, config.worker_id, engine, config.reader_tp,
                                  **transfer_listen_opts(config.kv_transfer_backend, endpoint, config.tls))
        # What the prefix cache adds and evicts, for KV-aware routers (read in Stats polls).
        cache_log = cache_log or CacheEventLog.following(engine.blocks, config.cache_event_log_size, engine.kv_tier)
        super().__init__(config, engine, agent, hooks=[self._poll_releases, self._note_chunk, self._publish_kv,
                                                       lambda: self.prefix_pulls.poll()],
                         cache_log=cache_log)
        self.endpoint = endpoint
        # Test-only fault injection (tests/conformance, ``ServerActor.inject_fault``): while
        # True, a Prefill call is accepted and never answered, however long its caller waits.
        self.inject_never_answer = False
        self.never_answered = 0  # the calls it has left unanswered so far
        # The reversed pull: prefixes read from decode workers before their prompts are queued.
        self.prefix_pulls = PrefixPulls(engine, self.agent, self.push, MetricLabels(
            config.worker_id, config.kv_transfer_backend, config.model_name), config.verify_kv)
        self.prefix_peers = PrefixPeers(self.agent, config.tls)
        self.leases = LeaseTable()
        self.agent.read_guard = self.leases.read_allowed  # tcp serves only claimed leases' blocks
        # Every request here, from its Prefill until ``forget``: queued, computing, or HELD.
        self.records: dict[str, RequestRecord] = {}
        # Queue time ends when a prompt's first chunk runs. Hooks run right before each step,
        # so the last hook's time is when the step now running started.
        self._step_started = time.monotonic()
        self.owners = OwnerClock(config.owner_timeout_s)  # router incarnations, when each last called
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- called from the asyncio loop ----------------------------------------------
    def note_poll(self, router_id: str) -> None:
        """A router (incarnation ``router_id``) called: it is alive (see ``owner_timeout_s``)."""
        self.owners.seen(router_id)

    async def prefill(self, request_id: str, prompt: list[int], params: SamplingParams,
                      owner: str = "", prefix: KVHandle | None = None) -> PrefillResult:
        """Queue the prompt, wait for its first token; the KV stays held under a lease granted
        to ``owner`` (the asking router's incarnation). Raises StepFailed if the step that ran
        it raised, SequenceFailed if its own fault ended it (the request is gone then)."""
        async with contextlib.aclosing(self.prefill_stream(request_id, prompt, params, owner, prefix=prefix)) as stream:
            async for result in stream:
                return result
        raise AssertionError("prefill_stream ended without an answer")

    def salt_of(self, params: SamplingParams) -> str:
        """``kv_salt`` of a request's ``params`` with its adapter's fingerprint as held here now
        (stated in the KV handles this worker gives out, for the reader to check)."""
        return kv_salt(params, fingerprint_of(self.engine.lora, params))

    async def prefill_stream(self, request_id: str, prompt: list[int], params: SamplingParams,
                             owner: str = "", stream_kv: bool = False, prefix: KVHandle | None = None
                             ) -> AsyncIterator[KVEarly | KVReady | PrefillResult]:
        """``prefill``, as a stream. With ``stream_kv`` the lease comes early: ``KVEarly``
        once the prompt has blocks and a chunk has run, ``KVReady`` after each later chunk,
        and the ``PrefillResult`` last (a prompt done in one step yields only that). Raises
        StepFailed, SequenceFailed, or KVLeaseEnded if the early lease ended before the prompt
        was done. Unless it hands out a lease, the request is forgotten when the call ends.
        ``prefix``: a decode worker holds the prompt's cached prefix; it is read first
        (``pdserve.prefill_worker.prefix_pull``), or, if that fails, the prompt computed whole."""
        if request_id in self.records:  # checked before its stream and record are replaced
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        self._loop = asyncio.get_running_loop()
        self.note_poll(owner)
        hashes = None
        # The adapter's identity as this worker holds it now (an adapter reloaded before the
        # request is queued gives it another salt, so what is pulled under this one is not its).
        salt = self.salt_of(params)
        if params.prompt_logprobs is None:  # else no prefix hit (every position is run)
            hashes = prompt_block_hashes(prompt, self.engine.blocks.block_size, salt)
        record = self.records[request_id] = RequestRecord(request_id, owner, time.monotonic(), hashes, stream_kv,
                                                          chunks=[] if tracing.enabled() else None)
        stream = self.open_stream(request_id)
        held = False
        try:
            if prefix is not None:  # (not with prompt logprobs: every position runs, ``hashes`` is None)
                # An adapter's prefix held under another salt was computed with other weights
                # under its name (the holder or this worker reloaded it): refused, computed here.
                same = not params.lora_name or prefix.kv_salt == salt
                await read_prefix(self.call, self.prefix_pulls, self.prefix_peers, request_id, prompt, salt,
                                  prefix, stream, wanted=hashes is not None and same)
            await self.call(self.engine.add_request, request_id, prompt, params, True)
            while True:
                item = await stream.get()
                if isinstance(item, (StepFailed, SequenceFailed, KVLeaseEnded)):
                    if record.watch is not None:
                        record.watch.update(failed=f"the prompt stopped: {item}")
                    raise item
                if isinstance(item, KVEarly):
                    record.watch = KVWatch(item.ready_tokens, item.checksums)
                elif isinstance(item, KVReady):
                    record.watch.update(ready_tokens=item.ready_tokens, checksums=item.checksums)
                else:
                    held = item.lease is not None
                    if record.watch is not None and held:
                        record.watch.update(ready_tokens=item.num_prompt_tokens, first_token=item.first_token_id,
                                            checksums=tuple(item.lease.checksums))
                    elif record.watch is not None:
                        record.watch.update(failed=f"the prompt finished at its first token ({item.finish_reason})")
                yield item
                if not isinstance(item, (KVEarly, KVReady)):
                    return
        finally:
            self.close_stream(request_id)
            if not held:  # the request ends with this call; if it was cancelled, what it holds goes
                record.caller_gone = True
                if record.watch is not None:  # (a watch that already ended keeps its news)
                    record.watch.update(failed="the prefill call was cancelled")
                self.thread.call(self.forget, request_id, record)

    async def claim(self, token: str, block_ids: list[int], renew: bool = False) -> Lease | None:
        """Claim the lease ``token`` for one read of ``block_ids``; raises LeaseRefused. With
        ``renew``, renew its reader's claim instead (None if it is not claimed). On the loop:
        the table is locked, and a claim must not wait behind a long prefill step."""
        now, ttl_s = time.monotonic(), self.config.lease_seconds
        return self.leases.renew_claim(token, now, ttl_s) if renew else self.leases.claim(token, block_ids, now, ttl_s)

    async def release(self, token: str, reason: ReleaseReason) -> bool:
        """The ``Release`` RPC; False if it changed nothing. A give-back (RETURNED) is table
        bookkeeping, answered here on the loop like a claim; a release that ends the lease
        frees its blocks on the engine thread."""
        if not reason.ends_lease:
            return self.leases.release(token, reason) is not None
        return await self.call(self._end_lease, token, reason)

    def watch(self, token: str) -> KVWatch | None:
        """The progress of the streamed lease ``token``; None once it has ended (or if it is
        not a streamed lease)."""
        lease = self.leases.get(token)
        record = self.records.get(lease.request_id) if lease is not None else None
        return record.watch if record is not None else None

    def owns(self, request_id: str) -> bool:
        return request_id in self.records

    def in_flight(self) -> int:
        """Prompts computing, and KV held for a decode worker that has yet to read it."""
        return super().in_flight() + len(self.leases)

    def stats_extra(self) -> dict:
        return {"num_held_leases": len(self.leases), "leases_expired": self.leases.expired_total,
                "num_claimed_leases": self.leases.num_claimed, "block_size": self.engine.blocks.block_size}

    def stats(self, metrics_address: str = "") -> worker_pb2.WorkerStats:
        """The shell's stats, but queued prompt tokens that the prefix cache holds are not
        counted: the worker will not compute them. (A queued prompt gets its blocks, and its
        hits, only when it reaches the head of the queue.) Without this, a worker that caches a
        popular prefix would report every queued request on it at full length, and routers
        would send that prefix elsewhere, to be computed again."""
        stats = super().stats(metrics_address)
        stats.num_waiting_tokens = max(0, stats.num_waiting_tokens - self._queued_hit_tokens())
        stats.prefix_tokens_read, stats.prefix_reads_refused = self.prefix_pulls.tokens_read, self.prefix_pulls.refused
        stats.kv_unverified_refused = self.prefix_pulls.unverified
        return stats

    def _queued_hit_tokens(self) -> int:
        blocks, hit_blocks = self.engine.blocks, 0
        for seq in list(self.engine.scheduler.waiting):  # a racy read, as shell.stats explains
            record = self.records.get(seq.seq_id)
            hashes = record.prompt_hashes if record is not None else None
            if hashes and not blocks.has(seq.seq_id):  # admitted ones count only what is left already
                hit_blocks += self.cache_log.cached_prefix(hashes)
        return hit_blocks * blocks.block_size

    # ---- engine thread -------------------------------------------------------------
    def forget(self, request_id: str, record: RequestRecord | None = None) -> None:
        """``request_id`` leaves this worker: the exit every path ends in. Its lease ends
        (ABORTED, unless it has ended already), its blocks are freed wherever it is, its
        watchers hear that it ended, and its record goes. ``record``: forget only that one
        (a late call about a request whose id was reused since does nothing). Idempotent."""
        if record is not None and self.records.get(request_id) is not record:
            return
        record = self.records.pop(request_id, None)
        if record is None:
            return
        if record.lease is not None:
            self.leases.release(record.lease.token, ReleaseReason.ABORTED)
        self.prefix_pulls.drop(request_id)
        self.engine.abort(request_id)
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(_watch_ended, record)
            except RuntimeError:  # the loop has closed
                pass

    def adopt(self, request_id: str, block_ids: list[int], num_tokens: int) -> Lease:
        """Engine thread: hold under a lease, as if prefilled here, the KV (``num_tokens`` computed tokens) of a
        stream this process's decode core handed over (``pdserve.elastic_worker``). No owner: unread, it expires."""
        now = time.monotonic()
        record = self.records[request_id] = RequestRecord(request_id, "", now, None, False, computing=False)
        record.lease = self.leases.grant(request_id, block_ids, now, self.config.lease_seconds)
        self._checksum_final(record.lease, num_tokens, done=True)
        self._expect_reads()
        return record.lease

    def _checksum_final(self, lease: Lease, num_tokens: int, done: bool) -> None:
        """Engine thread: ``Lease.checksum_final`` (nothing with ``verify_kv`` off)."""
        if self.config.verify_kv:
            lease.checksum_final(self.agent.block_checksums, self.engine.cache_spec, num_tokens, done)

    def _publish_kv(self) -> None:
        """Hook, before each step: grant a streamed prompt its lease once it has blocks and
        a chunk has run, then announce each chunk computed since (the step that just ended).
        Each announcement renews the lease: it expires only if the prompt stops moving."""
        streaming = [r for r in list(self.records.values()) if r.streaming]
        if not streaming:
            return None
        now, out = time.monotonic(), []
        for record in streaming:
            ready = self.engine.prompt_progress(record.request_id)
            if not ready or ready == record.announced_tokens:
                continue
            granted = record.lease is None
            if granted:
                record.lease = self.leases.grant(record.request_id, self.engine.blocks.block_table(record.request_id),
                                                 now, self.config.lease_seconds, owner=record.owner)
            else:
                self.leases.renew(record.lease.token, now + self.config.lease_seconds)
            out.append((record, ready, granted))
            record.announced_tokens = ready
        if out:
            # The step that computed these chunks may still be writing their KV on the device:
            # a decode worker reads it the moment it hears of it, and checksums need it final.
            wait_for_writes(self.engine.device)
        self._expect_reads()  # a lease granted here gets its early reads progressed
        for record, ready, _ in out:
            self._checksum_final(record.lease, ready, done=False)
        self.push((r.request_id, KVEarly(r.lease, ready, tuple(r.lease.checksums)) if granted
                   else KVReady(ready, tuple(r.lease.checksums))) for r, ready, granted in out)
        return None

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        self.push(self._result(o) for o in outputs if o.finished)

    def _result(self, o: RequestOutput) -> tuple[str, PrefillResult | SequenceFailed | None]:
        record = self.records.get(o.request_id)
        if record is None or record.caller_gone:  # the caller gave up while the step ran
            self.engine.abort(o.request_id)  # (a HELD sequence's blocks; forget comes next)
            return o.request_id, None
        record.computing, record.prompt_hashes = False, None
        started = record.arrived_at
        computing_since = record.first_chunk_at if record.first_chunk_at is not None else self._step_started
        lease = record.lease
        if o.error is not None or o.finish_reason is not None:  # no KV to read: the request leaves
            self.forget(o.request_id)
            if o.error is not None:  # its own fault ended it alone
                return o.request_id, o.error
            lease = None
        elif lease is not None:
            self.leases.renew(lease.token, time.monotonic() + self.config.lease_seconds)
        else:
            lease = record.lease = self.leases.grant(o.request_id, self.engine.held_block_ids(o.request_id),
                                                     time.monotonic(), self.config.lease_seconds, owner=record.owner)
        if lease is not None:
            self._checksum_final(lease, o.num_prompt_tokens, done=True)
            self._expect_reads()  # the (last) read, whose notice frees the blocks, comes now
        now = time.monotonic()
        chunks = ()
        if record.chunks is not None:  # the last chunk is the step that just ended
            chunks = (*record.chunks, (self._step_started, now, o.num_prompt_tokens))
        return o.request_id, PrefillResult(
            o.new_token_ids[0], o.new_logprobs[0] if o.new_logprobs else 0.0, o.finish_reason,
            o.num_prompt_tokens, lease, o.num_cached_tokens, now - started,
            max(0.0, computing_since - started), o.new_top_logprobs[0] if o.new_top_logprobs else (),
            o.prompt_logprobs, started, chunks)

    def _expect_reads(self) -> None:
        """Holder-side progress (NIXL: a thread waking every millisecond, on this worker's
        core) completes reads of held KV and delivers their notices. Leases of prompts still
        computing get only early reads, which nobody waits on: relaxed progress (every 100 ms)
        completes those without taking the prefill's core a thousand times a second."""
        held = len(self.leases)
        streaming = sum(1 for r in list(self.records.values()) if r.streaming and r.lease is not None) if held else 0
        self.agent.expect_reads(held > 0, urgent=held > streaming)

    def _poll_releases(self) -> float | None:
        self._expect_reads()
        if not self.leases:
            return None
        now = time.monotonic()
        upkeep(self.leases, self.agent.get_notifications(), now, self._lease_ended, self.owners)
        if not self.leases:  # the last lease just ended: the progress thread may sleep again
            self._expect_reads()  # (else it woke every millisecond until the next request)
            return None
        return max(0.0, min(NOTIFICATION_POLL_S, self.leases.next_deadline() - now))

    def _note_chunk(self) -> None:
        """Remember when a chunked prompt's first chunk ran (the step that just ended), and
        while tracing each of its chunks.

        Only the head of the waiting queue can be part-computed: a chunked prompt stays
        there until its last chunk. A prompt computed in one step is seen in ``_on_outputs``.
        """
        now = time.monotonic()
        waiting = self.engine.scheduler.waiting
        if waiting and waiting[0].num_computed_tokens > waiting[0].num_cached_tokens:
            record = self.records.get(waiting[0].seq_id)
            if record is not None and record.first_chunk_at is None:
                record.first_chunk_at = self._step_started
            computed = waiting[0].num_computed_tokens
            if record is not None and record.chunks is not None and (not record.chunks or record.chunks[-1][2] < computed):
                record.chunks.append((self._step_started, now, computed))
        self._step_started = now

    def _end_lease(self, token: str, reason: ReleaseReason) -> bool:
        """End the lease ``token`` for ``reason`` and free its blocks; False if it is gone."""
        lease = self.leases.release(token, reason)
        if lease is None:
            return False
        self._lease_ended(lease, reason)
        return True

    def _lease_ended(self, lease: Lease, reason: ReleaseReason) -> None:
        """The table ended ``lease``: its request leaves. A streamed prompt still computing is
        stopped, and its ``prefill_stream`` raises KVLeaseEnded."""
        record = self.records.get(lease.request_id)
        if record is not None and record.computing:
            self.push([(lease.request_id, KVLeaseEnded(f"its KV lease ended ({reason.value}) before it was done"))])
        self.forget(lease.request_id)

    def abort_now(self, request_id: str) -> bool:
        """The ``Abort`` RPC: stops a prompt still computing. KV handed out under a lease is
        not touched: it leaves only by its lease token (request ids are chosen by clients)."""
        record = self.records.get(request_id)
        if record is not None and record.lease is not None:
            return False
        found = self.engine.abort(request_id)
        self.forget(request_id)
        return found


def _watch_ended(record: RequestRecord) -> None:
    """Loop: a forgotten request's watchers learn that its lease ended, if it ended early."""
    if record.watch is not None:
        record.watch.update(failed="the lease ended before the prompt was done")
