"""The decode worker's core: the shared worker shell plus what only decode has, the KV reads
in flight."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable

from engine.config import MIXED, EngineConfig
from engine.errors import StepFailed
from engine.llm_engine import LLMEngine, RequestOutput
from engine.sampling import SamplingParams
from kv_transfer import DEFAULT_BACKEND, InvalidTransferRequest, TransferHandle, TransferState, create_agent
from kv_transfer.handoff import KVHandle
from protos import kv_transfer_pb2
from wire import metrics
from wire.address import resolve, transfer_listen_opts
from wire.tls import TlsConfig
from wire.worker_shell import WorkerShell

# While a read is in flight the engine thread checks on it at least this often (between
# steps it checks every iteration); with no read in flight it does not poll at all.
TRANSFER_POLL_S = 0.0005


@dataclass(frozen=True)
class DecodeWorkerConfig:
    worker_id: str = "decode-0"
    model_name: str = "smollm2"  # the served name (the first), the workers' metrics label model_name
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str | None = "127.0.0.1"  # internal plane bind address; None: the node's IP (wire.address)
    advertise_host: str | None = None  # what peers dial; None: from host (wire.address.resolve)
    tls: TlsConfig | None = None  # mTLS on the internal plane (wire.tls)
    port: int = 0
    metrics_port: int = 0  # Prometheus /metrics on host; 0: any free port (Stats tells which)
    kv_transfer_backend: str = DEFAULT_BACKEND
    transfer_timeout_s: float = 10.0  # a read not done by then fails (and the router re-prefills)
    inject_transfer_delay_s: float = 0.0  # fault-injection hook for tests: slows every read
    drain_grace_s: float = 30.0  # on SIGTERM: how long in-flight streams may finish
    max_requests: int = 1024  # requests held at once (waiting for KV, queued or running); past it RESOURCE_EXHAUSTED
    max_receive_bytes: int = 4 << 20  # largest gRPC request its server accepts; larger: RESOURCE_EXHAUSTED
    cpus: tuple[int, ...] = ()  # cores this worker's threads run on (sched_setaffinity); empty: any


@dataclass(frozen=True)
class KVArrived:
    nbytes: int
    seconds: float


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


class DecodeWorker(WorkerShell):
    role = "decode"

    def __init__(self, config: DecodeWorkerConfig, engine: LLMEngine | None = None):
        engine = engine or LLMEngine.from_config(decode_engine_config(config.engine), detokenize=False)
        endpoint = resolve(config.host, config.advertise_host)  # internal plane: bind + advertised host
        agent = create_agent(config.kv_transfer_backend, config.worker_id, engine.kv_cache,
                             inject_delay_s=config.inject_transfer_delay_s, read_timeout_s=config.transfer_timeout_s,
                             **transfer_listen_opts(config.kv_transfer_backend, endpoint, config.tls))
        super().__init__(config, engine, agent, hooks=[self._poll_transfers])
        self.endpoint = endpoint
        self._transfers: dict[str, TransferHandle] = {}

    def add_peer(self, meta: kv_transfer_pb2.AgentMetadata) -> str:
        return self.agent.add_remote(meta)

    def source_unreachable(self) -> None:
        """Count a pull that could not start (the prefill worker gave no usable metadata) as
        a failed transfer: the KV did not move, and that is never silent."""
        self.agent.stats.record(TransferState.FAILED, 0, 0.0)

    # ---- called from the asyncio loop ----------------------------------------------
    async def decode(self, request_id: str, prompt: list[int], first_token: int, params: SamplingParams,
                     kv: KVHandle, peer: str, claim: Callable[[], Awaitable[None]]
                     ) -> AsyncIterator[RequestOutput | KVArrived]:
        """Take the request (blocks here first: CacheCapacityError before any claim), claim
        the lease (``claim``), pull the KV from agent ``peer``, then yield ``KVArrived`` once
        and the request's outputs as they come.

        Raises TransferFailed if the KV never arrives, StepFailed if a step holding the
        request raised. Closing the iterator early (the caller was cancelled) aborts the
        request and its transfer.
        """
        stream = self.open_stream(request_id)
        finished = False
        try:
            local = await self.call(self.engine.add_prefilled, request_id, prompt, first_token, params)
            await claim()
            await self.call(self._start_read, request_id, kv, peer, local)
            while not finished:
                item = await stream.get()
                if isinstance(item, (TransferFailed, StepFailed)):
                    finished = True
                    raise item
                finished = isinstance(item, RequestOutput) and item.finished
                yield item
        finally:
            self.close_stream(request_id)
            if not finished:
                self.thread.call(self.cancel, request_id)

    async def prefill_and_decode(self, request_id: str, prompt: list[int], params: SamplingParams
                                 ) -> AsyncIterator[RequestOutput | LocallyPrefilled]:
        """Prefill ``prompt`` here (its chunks share steps with the running streams), then
        decode: yields ``LocallyPrefilled`` once, just before the first output, then the
        request's outputs as they come. Raises StepFailed if a step holding the request
        raised; closing the iterator early aborts the request."""
        stream = self.open_stream(request_id)
        arrived = time.monotonic()
        finished = first = False
        try:
            await self.call(self.engine.add_request, request_id, prompt, params)
            while not finished:
                item = await stream.get()
                if isinstance(item, StepFailed):
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
                self.thread.call(self.cancel, request_id)

    # ---- engine thread -------------------------------------------------------------
    def _start_read(self, request_id: str, kv: KVHandle, peer: str, local: list[int]) -> None:
        if not self.engine.blocks.has(request_id):  # aborted meanwhile
            raise TransferFailed("the request was aborted before its read started")
        try:
            self._transfers[request_id] = self.agent.start_read(
                peer, kv.block_ids, local, notify=kv.lease_token.encode(),
                last_block_bytes=kv.last_block_bytes(self.engine.blocks.block_size,
                                                     self.engine.cache_spec.bytes_per_token))
        except InvalidTransferRequest as exc:
            self.engine.abort(request_id)
            raise TransferFailed(f"the handle does not fit the holder's cache: {exc}") from exc

    def _poll_transfers(self) -> float | None:
        arrived = []
        for request_id, handle in list(self._transfers.items()):
            state = self.agent.poll(handle)
            if not state.is_terminal:
                continue
            del self._transfers[request_id]
            if state is TransferState.DONE:
                self.engine.kv_ready(request_id)
                seconds = handle.finished_at - handle.started_at
                metrics.kv_transfer_done(self.role, self.config.worker_id, self.config.kv_transfer_backend, seconds,
                                         handle.nbytes, len(handle.local_block_ids),  # one descriptor per block
                                         self.config.model_name)
                arrived.append((request_id, KVArrived(handle.nbytes, seconds)))
            else:
                self.engine.abort(request_id)
                arrived.append((request_id, TransferFailed(f"KV transfer {state.name.lower()}: {handle.error}")))
        if arrived:
            self.push(arrived)
        return TRANSFER_POLL_S if self._transfers else None

    def cancel(self, request_id: str) -> bool:
        handle = self._transfers.pop(request_id, None)
        if handle is not None:
            self.agent.abort(handle)
        return self.engine.abort(request_id)
