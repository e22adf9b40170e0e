"""The prefill worker's core: engine thread, KV agent and leases, driven from asyncio."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.engine_thread import EngineThread
from engine.llm_engine import LLMEngine, RequestOutput
from engine.sampling import SamplingParams
from kv_transfer import create_agent
from prefill_worker.leases import Lease, LeaseTable
from wire.address import resolve, transfer_listen_opts
from wire.tls import TlsConfig


@dataclass(frozen=True)
class PrefillWorkerConfig:
    worker_id: str = "prefill-0"
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str | None = "127.0.0.1"  # internal plane bind address; None: the node's IP (wire.address)
    advertise_host: str | None = None  # what peers dial; None: from host (wire.address.resolve)
    tls: TlsConfig | None = None  # mTLS on the internal plane (wire.tls)
    port: int = 0  # 0: any free port
    metrics_port: int = 0  # Prometheus /metrics on host; 0: any free port (Stats tells which)
    lease_seconds: float = 30.0  # held KV is freed this long after the first token at the latest
    kv_transfer_backend: str = "nixl"


@dataclass(frozen=True)
class PrefillResult:
    first_token_id: int
    first_logprob: float
    finish_reason: str | None  # None: generation continues on a decode worker
    block_ids: list[int]
    num_prompt_tokens: int
    lease: Lease | None
    num_cached_tokens: int
    seconds: float  # queue + compute
    queue_seconds: float  # of ``seconds``: before the prompt's first chunk ran


class PrefillWorker:
    def __init__(self, config: PrefillWorkerConfig, engine: LLMEngine | None = None):
        self.config = config
        self.engine = engine or LLMEngine.from_config(config.engine)
        self.endpoint = resolve(config.host, config.advertise_host)  # internal plane: bind + advertised host
        self.agent = create_agent(config.kv_transfer_backend, config.worker_id, self.engine.kv_cache,
                                  **transfer_listen_opts(config.kv_transfer_backend, self.endpoint))
        self.leases = LeaseTable()
        self.draining = False  # set by Drain: no new requests, the current ones finish
        self.released_by = {"pulled": 0, "release_rpc": 0, "expired": 0}
        self._pending: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future, float]] = {}
        # Queue time ends when a prompt's first chunk runs. Hooks run right before each step,
        # so the last hook's time is when the step now running started.
        self._step_started = time.monotonic()
        self._first_chunk_at: dict[str, float] = {}  # prompts whose first of several chunks ran
        self.thread = EngineThread(self.engine, self._on_outputs, hooks=[self._poll_releases, self._note_chunk],
                                   name=f"{config.worker_id}-engine")

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.thread.stop()
        self.agent.close()

    # ---- called from the asyncio loop ----------------------------------------------
    async def prefill(self, request_id: str, prompt: list[int], params: SamplingParams) -> PrefillResult:
        """Queue the prompt, wait for its first token; the KV stays held under a lease."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._pending[request_id] = (loop, fut, time.monotonic())
        try:
            await asyncio.wrap_future(self.thread.call(self.engine.add_request, request_id, prompt, params, True))
            return await fut
        except BaseException:
            self._pending.pop(request_id, None)
            self.thread.call(self._cancel, request_id)
            raise
        finally:
            self._pending.pop(request_id, None)

    async def release(self, lease_id: str) -> bool:
        return await asyncio.wrap_future(self.thread.call(self._release_lease, lease_id, "release_rpc"))

    async def abort(self, request_id: str) -> bool:
        return await asyncio.wrap_future(self.thread.call(self._cancel, request_id))

    # ---- engine thread -------------------------------------------------------------
    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        for o in outputs:
            if not o.finished:
                continue
            computing_since = self._first_chunk_at.pop(o.request_id, self._step_started)
            pending = self._pending.get(o.request_id)
            if pending is None:  # the caller gave up while the step ran
                self.engine.release(o.request_id)
                continue
            loop, fut, started = pending
            lease, block_ids = None, []
            if o.finish_reason is None:
                lease = Lease(uuid.uuid4().hex, o.request_id, time.monotonic() + self.config.lease_seconds)
                self.leases.add(lease)
                block_ids = self.engine.held_block_ids(o.request_id)
            result = PrefillResult(o.new_token_ids[0], o.new_logprobs[0] if o.new_logprobs else 0.0,
                                   o.finish_reason, block_ids, o.num_prompt_tokens, lease,
                                   o.num_cached_tokens, time.monotonic() - started,
                                   max(0.0, computing_since - started))
            loop.call_soon_threadsafe(_resolve, fut, result)

    def _poll_releases(self) -> None:
        for note in self.agent.get_notifications():
            self._release_lease(note.decode(), "pulled")
        for lease in self.leases.pop_expired(time.monotonic()):
            self.engine.release(lease.request_id)
            self.released_by["expired"] += 1

    def _note_chunk(self) -> None:
        """Remember when a chunked prompt's first chunk ran (the step that just ended).

        Only the head of the waiting queue can be part-computed: a chunked prompt stays
        there until its last chunk. A prompt computed in one step is seen in ``_on_outputs``.
        """
        waiting = self.engine.scheduler.waiting
        if waiting and waiting[0].num_computed_tokens > waiting[0].num_cached_tokens:
            self._first_chunk_at.setdefault(waiting[0].seq_id, self._step_started)
        self._step_started = time.monotonic()

    def _release_lease(self, lease_id: str, why: str) -> bool:
        lease = self.leases.pop(lease_id)
        if lease is None:
            return False
        self.engine.release(lease.request_id)
        self.released_by[why] += 1
        return True

    def _cancel(self, request_id: str) -> bool:
        self._first_chunk_at.pop(request_id, None)
        for lease in [l for l in self.leases.leases.values() if l.request_id == request_id]:
            self.leases.pop(lease.lease_id)
        return self.engine.abort(request_id)


def _resolve(fut: asyncio.Future, result) -> None:
    if not fut.done():
        fut.set_result(result)
