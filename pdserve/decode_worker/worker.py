"""The decode worker's core: the shared worker shell plus what only decode has, the KV reads
in flight.

A prompt's KV arrives in one read after its prefill, or, streamed (``watch``), in one read per
newly finished stretch of blocks while the prefill worker still computes, then a last read
of the rest, once every earlier one is done. Either way the same bytes land in the same
blocks, the last read ends the lease on the holder, and any failed read fails the request's
transfer as a whole."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, Optional

from pdserve.decode_worker.config import DecodeWorkerConfig
from pdserve.engine.config import MIXED, EngineConfig
from pdserve.engine.core.block_hashes import kv_salt
from pdserve.engine.errors import InvalidRequestError, SequenceFailed, StepFailed
from pdserve.engine.llm_engine import LLMEngine, RequestOutput
from pdserve.engine.lora.manager import fingerprint_of
from pdserve.engine.sampling.params import SamplingParams
from pdserve.kv_transfer import InvalidTransferRequest, KVTransferAgent, TransferHandle, TransferState, UnverifiedTransfer
from pdserve.kv_transfer.handoff import KVHandle
from pdserve.kv_transfer.rank_agents import RankAgents, RankSources
from pdserve.decode_worker.prefix_hold import PrefixHolds
from pdserve.protos import kv_transfer_pb2
from pdserve.wire import worker_metrics
from pdserve.wire.address import resolve, transfer_listen_opts
from pdserve.wire.internal_plane import check_bind
from pdserve.shell.agents import worker_agents, worker_engine
from pdserve.shell.cache_events import CacheEventLog
from pdserve.shell.read_quarantine import ReadQuarantine
from pdserve.shell.worker import WorkerShell

log = logging.getLogger(__name__)

# While a read is in flight the engine thread checks on it at least this often (between
# steps it checks every iteration); with no read in flight it does not poll at all.
TRANSFER_POLL_S = 0.0005
# A stream whose KV is on its way holds the next step for a share of the last step's time (at
# most HOLD_CAP_S) from its latest move: added here, then from the start of its last read.
# Otherwise a hand-off that lands mid-step waits out that step and a whole one more: at 2
# req/s on 2 cores (docs/benchmarks/history.md) a stream's first-to-second-token gap was
# nearly three decode steps, and the ITL p99 of the whole run. The claim and a shared-memory read of a
# 256-token prompt take a few ms; the streams running pay at most the share, once per hand-off.
HOLD_SHARE = 0.3
HOLD_CAP_S = 0.02


@dataclass(frozen=True)
class KVArrived:
    nbytes: int
    seconds: float  # from the last read's start (streamed KV: what was left after the prefill)
    started_at: float = 0.0  # time.monotonic() when the first read started
    finished_at: float = 0.0  # ... and when the last one finished
    blocks: int = 0  # descriptors read (a block each; by head, a row each)
    reused_blocks: int = 0  # leading blocks this worker's prefix cache had: not read, not in nbytes


@dataclass(frozen=True)
class KVProgressed:
    """Streamed KV: a read of more finished blocks started while prefill goes on."""

    ready_tokens: int


@dataclass
class _Pull:
    """One request's reads of its prompt's KV."""

    handles: list[TransferHandle] = field(default_factory=list)
    next_block: int = 0  # blocks before this one have a read started, or are reused (never read)
    reused_blocks: int = 0  # the first blocks, which this worker's prefix cache had (_Landing)
    final_at: Optional[float] = None  # when the last read (the rest, ending the lease) started
    # Streamed: the last read, held back until every earlier read is DONE (its notice ends the
    # lease, and the holder frees the blocks they may still be reading); ``_poll_transfers`` starts it.
    deferred: Optional[Callable[[], None]] = None
    first_token: Optional[int] = None  # streamed: learnt with the end of the prompt


@dataclass(frozen=True)
class _Landing:
    """Where a prompt's KV lands here: its blocks (the handle's, position for position), the
    first ``reused`` of which this worker's prefix cache gave it (``decode_kv_reuse``): final
    here already, never read. The block of the prompt's last token is never one of them
    (``BlockManager.allocate``), so the last read always moves a block, and its notice ends the
    lease on the holder however much was reused."""

    block_ids: list[int]
    reused: int = 0


# Streamed KV's progress as the decode worker hears it: (prompt tokens computed, the first
# token once the whole prompt is, the checksums of the blocks final so far).
Watch = Callable[[], AsyncIterator[tuple[int, Optional[int], tuple[int, ...]]]]


@dataclass(frozen=True)
class LocallyPrefilled:
    """Sent before the first output of a request this worker prefilled itself."""

    seconds: float  # arrival here to the first token: queue + prompt compute


def decode_engine_config(engine: EngineConfig) -> EngineConfig:
    """A decode worker's engine runs the ``mixed`` policy: a prompt it prefills (locally, or
    a preempted sequence it recomputes) shares steps with its running streams instead of
    stopping them for the whole prompt."""
    return dataclasses.replace(engine, scheduler=dataclasses.replace(engine.scheduler, policy=MIXED))


class TransferFailed(Exception):
    """The prompt's KV could not be pulled; the request was aborted here."""


class KVUnverified(TransferFailed):
    """The holder sent no checksums and this worker verifies (``verify_kv``): nothing was read."""


class HandedOver(Exception):
    """This worker gave the stream up before it finished (``hand_over_streams``: it stops
    decoding, for a new role, past its grace). With ``kv``, the stream's KV stays here under a
    lease and the router moves the stream to another decode worker, which reads the KV and
    decodes on; without, the request is aborted here and the router migrates it (a re-prefill
    of prompt + tokens sent on another pair)."""

    def __init__(self, why: str, kv: KVHandle | None = None):
        super().__init__(why)
        self.kv = kv


# On the engine thread, for a stream handed over: keep its KV for another decode worker and
# return the handle to it, or None where it cannot move (``hand_over_streams``).
Keep = Callable[[str], Optional[KVHandle]]


class DecodeWorker(WorkerShell):
    role = "decode"

    def __init__(self, config: DecodeWorkerConfig, engine: LLMEngine | None = None,
                 agent: KVTransferAgent | RankAgents | None = None, cache_log: CacheEventLog | None = None):
        """``engine``, ``agent`` and ``cache_log`` (its prefix-cache events): ones this worker
        shares with a prefill worker in the same process (``pdserve.elastic_worker``); None: its
        own. Without ``decode_kv_reuse`` it publishes no events, whatever ``cache_log`` is."""
        engine = engine or worker_engine(decode_engine_config(config.engine))
        endpoint = resolve(config.host, config.advertise_host)  # internal plane: bind + advertised host
        check_bind(endpoint.bind_host, config.tls, config.insecure_internal, "the decode worker")  # before its KV listener
        own_agent = agent is None  # else shared with a prefill side, which takes the read notices
        if agent is None:
            agent = worker_agents(config.kv_transfer_backend, config.worker_id, engine, config.reader_tp,
                                  inject_delay_s=config.inject_transfer_delay_s, read_timeout_s=config.transfer_timeout_s,
                                  **transfer_listen_opts(config.kv_transfer_backend, endpoint, config.tls))
        if not config.decode_kv_reuse:
            cache_log = None
        elif cache_log is None:
            cache_log = CacheEventLog.following(engine.blocks, config.cache_event_log_size, engine.kv_tier)
        super().__init__(config, engine, agent, hooks=[self._poll_transfers, lambda: self.prefix_holds.poll(),
                                                       lambda: self.reads.poll()], holds=[self._hold_for_arrivals], cache_log=cache_log)
        self.reads = ReadQuarantine(self.agent, engine.blocks)  # stopped reads' blocks, until those reads are over
        self.endpoint = endpoint
        self.prefix_holds = PrefixHolds(engine, self.agent, config.lease_seconds, config.verify_kv, enabled=own_agent)
        self._pulls: dict[str, _Pull] = {}
        self._arriving: dict[str, float] = {}  # request -> its latest move (time.monotonic), until its KV is here
        self.unverified_refused = 0  # KV refused unread: it came without checksums (WorkerStats.kv_unverified_refused)

    def add_peer(self, meta: kv_transfer_pb2.AgentMetadata) -> RankSources:
        """Connect each rank's agent to the holder ranks it reads, from what a prefill worker publishes."""
        return self.agent.connect(meta)

    def source_unreachable(self) -> None:
        """Count a pull that could not start (the prefill worker gave no usable metadata) as
        a failed transfer: the KV did not move, and that is never silent."""
        self.agent.stats.record(TransferState.FAILED, 0, 0.0)

    def stats_extra(self) -> dict:
        """The block size the published hashes cover (a router reads the events with it)."""
        return {"block_size": self.engine.blocks.block_size, "kv_unverified_refused": self.unverified_refused}

    # ---- called from the asyncio loop ----------------------------------------------
    async def decode(self, request_id: str, prompt: list[int], first_token: int, params: SamplingParams,
                     kv: KVHandle, peer: RankSources, claim: Callable[[], Awaitable[None]], watch: Watch | None = None
                     ) -> AsyncIterator[RequestOutput | KVArrived | KVProgressed]:
        """Take the request (blocks here first: CacheCapacityError before any claim), claim
        the lease (``claim``), pull the KV from agent ``peer``, then yield ``KVArrived`` once
        and the request's outputs as they come.

        ``watch``: the KV is streamed (``first_token`` is a placeholder): read each stretch of
        blocks ``watch`` says is computed, yielding ``KVProgressed``, and the rest once it says
        the prompt is done, with the first token.

        Raises TransferFailed if the KV never arrives, StepFailed if a step holding the
        request raised, SequenceFailed if its own fault ended it. Closing the iterator early (the caller was cancelled) aborts the
        request and its transfer.
        """
        stream = self.open_stream(request_id)
        finished = False
        try:
            local = await self.call(self._add_arriving, request_id, prompt, first_token, params, kv.kv_salt)
            await claim()
            if watch is None:
                await self.call(self._start_read, request_id, kv, peer, local, kv.num_tokens, True, None,
                                kv.block_checksums)
            else:
                async for ready_tokens, first, sums in watch():
                    await self.call(self._start_read, request_id, kv, peer, local, ready_tokens,
                                    first is not None, first, sums)
                    if first is not None:
                        break
                    yield KVProgressed(ready_tokens)
                else:
                    raise TransferFailed("the prefill worker stopped streaming the KV before the prompt was done")
            while not finished:
                item = await stream.get()
                if isinstance(item, HandedOver):
                    finished = item.kv is not None  # its KV is the lease's now; else the finally aborts it
                    raise item
                if isinstance(item, (TransferFailed, StepFailed, SequenceFailed)):
                    finished = True
                    raise item
                finished = isinstance(item, RequestOutput) and item.finished
                yield item
        finally:
            self.close_stream(request_id)
            if not finished:
                await self._abort_and_wait(request_id)

    async def prefill_and_decode(self, request_id: str, prompt: list[int], params: SamplingParams
                                 ) -> AsyncIterator[RequestOutput | LocallyPrefilled]:
        """Prefill ``prompt`` here (its chunks share steps with the running streams), then
        decode: yields ``LocallyPrefilled`` once, just before the first output, then the
        request's outputs as they come. Raises StepFailed if a step holding the request
        raised, SequenceFailed if its own fault ended it; closing the iterator early aborts the request."""
        stream = self.open_stream(request_id)
        arrived = time.monotonic()
        finished = first = False
        try:
            await self.call(self.engine.add_request, request_id, prompt, params)
            while not finished:
                item = await stream.get()
                if isinstance(item, HandedOver):
                    finished = item.kv is not None  # its KV is the lease's now; else the finally aborts it
                    raise item
                if isinstance(item, (StepFailed, SequenceFailed)):
                    finished = True
                    raise item
                if not first:
                    first = True
                    yield LocallyPrefilled(time.monotonic() - arrived)
                finished = item.finished
                yield item
        finally:
            self.close_stream(request_id)
            if not finished:
                await self._abort_and_wait(request_id)

    async def hand_over_streams(self, why: str, keep: Keep | None = None) -> tuple[int, int]:
        """Give up every stream here (``HandedOver``), between two steps. ``keep`` (an elastic
        worker's) keeps a decoding stream's KV under a lease: its call sends every token made so
        far, then the handle, and ends. The others' calls end UNAVAILABLE, their requests are
        aborted and their blocks freed, and the router re-prefills them. Returns how many
        streams were handed over, and how many of them with their KV."""
        return await self.call(self._hand_over, why, keep)

    def _hand_over(self, why: str, keep: Keep | None) -> tuple[int, int]:
        # Here on the engine thread, each stream's outputs so far are already in its queue: the
        # handle comes after them, so the router has every token the KV was computed from.
        items = [(request_id, HandedOver(why, keep(request_id) if keep is not None else None))
                 for request_id in list(self._streams)]
        self.push(items)
        return len(items), sum(1 for _, item in items if item.kv is not None)

    async def _abort_and_wait(self, request_id: str) -> None:
        """Free what an unfinished request holds before its caller hears that it ended, so a
        Stats read right after the error sees its blocks free (a race a loaded machine hit).
        If the call is cancelled meanwhile the abort still runs, just unawaited."""
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(asyncio.wrap_future(self.thread.call(self.abort_now, request_id)))

    # ---- engine thread -------------------------------------------------------------
    def _add_arriving(self, request_id: str, prompt: list[int], first_token: int, params: SamplingParams,
                      holder_salt: str = "") -> _Landing:
        """Blocks for the prompt; with ``decode_kv_reuse``, the leading ones this worker's prefix
        cache holds are taken as they are (final here already) and the pull starts after them.
        An adapter's KV that its holder states it keyed by another salt (``KVHandle.kv_salt``: it
        ran other weights under the adapter's name) is refused, naming ``lora_name``."""
        if params.lora_name and holder_salt and holder_salt != kv_salt(params, fingerprint_of(self.engine.lora, params)):
            raise InvalidRequestError("lora_name", f"adapter {params.lora_name!r}: the KV's holder loaded other files "
                                      "under this name than this worker (one of them reloaded it); retry")
        reuse = self.config.decode_kv_reuse
        ids = self.engine.add_prefilled(request_id, prompt, first_token, params, reuse_cached=reuse)
        self._arriving[request_id] = time.monotonic()
        return _Landing(ids, self.engine.num_cached_tokens(request_id) // self.engine.blocks.block_size)

    def _hold_for_arrivals(self) -> float | None:
        """Until when the next step waits for streams whose KV is on its way (engine_thread holds)."""
        if not self._arriving:  # a stream leaves it when its KV lands or it is aborted (abort_now)
            return None
        return max(self._arriving.values()) + min(HOLD_CAP_S, HOLD_SHARE * self.thread.last_step_s)

    def _start_read(self, request_id: str, kv: KVHandle, peer: RankSources, local: _Landing, ready_tokens: int,
                    last: bool, first_token: int | None, sums: tuple[int, ...]) -> None:
        """Read the blocks not read yet that hold only computed tokens; with ``last``, every
        block not read yet, notifying the holder with the lease token (which ends the lease).
        Early reads leave the last block to the last read, so that one always moves a block.
        Blocks this worker's prefix cache gave the prompt (``_add_arriving``) are never read:
        the reads start past them, at the same place in the handle's block ids. ``sums``: the
        holder's checksums of the handle's first blocks, against which the read checks what
        lands (with ``verify_kv``; sums that do not cover every block read start no read at all:
        ``KVUnverified``, counted, and the router prefills the request again)."""
        if not self.engine.blocks.has(request_id):  # aborted meanwhile (or an early read failed)
            raise TransferFailed("the request was aborted before its read started")
        pull = self._pulls.setdefault(request_id, _Pull(next_block=local.reused, reused_blocks=local.reused))
        size, n = self.engine.blocks.block_size, len(kv.block_ids)
        end = n if last else min(ready_tokens // size, n - 1)
        if last and end <= pull.next_block:  # nothing left for the read whose notice ends the lease
            self.abort_now(request_id)
            raise TransferFailed(f"the handle names {n} blocks, none past the {pull.next_block} here already")
        if end <= pull.next_block:
            return
        if last and any(h.state is not TransferState.DONE for h in pull.handles):
            pull.deferred = functools.partial(self._start_read, request_id, kv, peer, local, ready_tokens, last,
                                              first_token, sums)
            return
        try:  # one read per rank pair (one between single-rank workers), each with its notice
            handles = self.agent.start(
                peer, kv.block_ids, local.block_ids, pull.next_block, end, lease_token=kv.lease_token, last=last,
                last_block_bytes=kv.last_block_bytes(self.engine.cache_spec) if last else None,
                sums=sums if self.config.verify_kv else None)
        except InvalidTransferRequest as exc:
            self.abort_now(request_id)
            raise TransferFailed(f"the handle does not fit the holder's cache: {exc}") from exc
        except UnverifiedTransfer as exc:  # fail closed: nothing read, the router prefills it again
            self.abort_now(request_id)
            self.unverified_refused += 1
            raise KVUnverified(str(exc)) from exc
        pull.handles.extend(handles)
        pull.next_block = end
        if last:
            pull.final_at, pull.first_token = handles[0].started_at, first_token
            if request_id in self._arriving:
                self._arriving[request_id] = handles[0].started_at

    def _poll_transfers(self) -> float | None:
        arrived = []
        for request_id, pull in list(self._pulls.items()):
            states = [self.agent.poll(h) for h in pull.handles]
            failed = next((h for h, state in zip(pull.handles, states)
                           if state.is_terminal and state is not TransferState.DONE), None)
            if failed is not None:
                self.abort_now(request_id)
                arrived.append((request_id, TransferFailed(f"KV transfer {failed.state.name.lower()}: {failed.error}")))
            elif pull.deferred is not None and all(state is TransferState.DONE for state in states):
                start, pull.deferred = pull.deferred, None
                try:
                    start()
                except TransferFailed as exc:
                    arrived.append((request_id, exc))
            elif pull.final_at is not None and all(state is TransferState.DONE for state in states):
                del self._pulls[request_id]
                self._arriving.pop(request_id, None)
                self.engine.kv_ready(request_id, pull.first_token)
                # The wait after the last read started: for streamed KV, what is left after prefill.
                finished_at = max(h.finished_at for h in pull.handles)
                seconds = finished_at - pull.final_at
                nbytes = sum(h.nbytes for h in pull.handles)
                blocks = sum(h.descriptors for h in pull.handles)  # NIXL descriptors a side (a run of adjacent blocks: one)
                worker_metrics.kv_transfer_done(self.role, self.config.worker_id, self.config.kv_transfer_backend, seconds,
                                                nbytes, blocks, self.config.model_name)
                started_at = min(h.started_at for h in pull.handles)
                arrived.append((request_id, KVArrived(nbytes, seconds, started_at, finished_at, blocks,
                                                      pull.reused_blocks)))
        if arrived:
            self.push(arrived)
        return TRANSFER_POLL_S if self._pulls else None

    def abort_now(self, request_id: str) -> bool:
        """Abort the request; the blocks its stopped reads may still write stay quarantined
        until those reads are over (``pdserve.shell.read_quarantine``)."""
        self._arriving.pop(request_id, None)
        pull = self._pulls.pop(request_id, None)
        landing = self.reads.stop(pull.handles if pull is not None else ())
        aborted = self.engine.abort(request_id, quarantine=landing.blocks)
        if aborted:
            self.reads.hold(landing)
        return aborted
