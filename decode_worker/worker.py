"""The decode worker's core: engine thread, KV agent and in-flight transfers, driven from asyncio."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from engine.config import EngineConfig
from engine.engine_thread import EngineThread
from engine.llm_engine import LLMEngine, RequestOutput
from engine.sampling import SamplingParams
from kv_transfer import TransferHandle, TransferState, create_agent
from protos import kv_transfer_pb2
from wire.address import resolve, transfer_listen_opts
from wire.tls import TlsConfig


@dataclass(frozen=True)
class DecodeWorkerConfig:
    worker_id: str = "decode-0"
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str | None = "127.0.0.1"  # internal plane bind address; None: the node's IP (wire.address)
    advertise_host: str | None = None  # what peers dial; None: from host (wire.address.resolve)
    tls: TlsConfig | None = None  # mTLS on the internal plane (wire.tls)
    port: int = 0
    metrics_port: int = 0  # Prometheus /metrics on host; 0: any free port (Stats tells which)
    kv_transfer_backend: str = "nixl"
    transfer_timeout_s: float = 10.0  # a read not done by then fails (and the router re-prefills)
    inject_transfer_delay_s: float = 0.0  # fault-injection hook for tests: slows every read


@dataclass(frozen=True)
class KVSource:
    """Where the prompt's KV is: the peer agent, its blocks, and the lease to name on completion."""

    peer: str
    block_ids: list[int]
    num_tokens: int
    lease_id: str


@dataclass(frozen=True)
class KVArrived:
    nbytes: int
    seconds: float


class TransferFailed(Exception):
    """The prompt's KV could not be pulled; the request was aborted here."""


class DecodeWorker:
    def __init__(self, config: DecodeWorkerConfig, engine: LLMEngine | None = None):
        self.config = config
        self.engine = engine or LLMEngine.from_config(config.engine)
        self.endpoint = resolve(config.host, config.advertise_host)  # internal plane: bind + advertised host
        self.agent = create_agent(config.kv_transfer_backend, config.worker_id, self.engine.kv_cache,
                                  inject_delay_s=config.inject_transfer_delay_s,
                                  read_timeout_s=config.transfer_timeout_s,
                                  **transfer_listen_opts(config.kv_transfer_backend, self.endpoint))
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.draining = False  # set by Drain: no new requests, the current ones finish
        self._transfers: dict[str, TransferHandle] = {}
        self.thread = EngineThread(self.engine, self._on_outputs, hooks=[self._poll_transfers],
                                   name=f"{config.worker_id}-engine")

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.thread.stop()
        self.agent.close()

    def add_peer(self, meta: kv_transfer_pb2.AgentMetadata) -> str:
        return self.agent.add_remote(meta)

    def source_unreachable(self) -> None:
        """Count a pull that could not start (the prefill worker gave no usable metadata) as
        a failed transfer: the KV did not move, and that is never silent."""
        self.agent.stats.record(TransferState.FAILED, 0, 0.0)

    # ---- called from the asyncio loop ----------------------------------------------
    async def decode(self, request_id: str, prompt: list[int], first_token: int, params: SamplingParams,
                     source: KVSource) -> AsyncIterator[RequestOutput | KVArrived]:
        """Pull the KV, then yield ``KVArrived`` once and the request's outputs as they come.

        Raises TransferFailed if the KV never arrives. Closing the iterator early (the
        caller was cancelled) aborts the request and its transfer.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, queue)
        finished = False
        try:
            await asyncio.wrap_future(self.thread.call(self._admit, request_id, prompt, first_token, params, source))
            while not finished:
                item = await queue.get()
                if isinstance(item, TransferFailed):
                    finished = True
                    raise item
                finished = isinstance(item, RequestOutput) and item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.thread.call(self._cancel, request_id)

    async def abort(self, request_id: str) -> bool:
        return await asyncio.wrap_future(self.thread.call(self._cancel, request_id))

    # ---- engine thread -------------------------------------------------------------
    def _admit(self, request_id: str, prompt: list[int], first_token: int, params: SamplingParams,
               source: KVSource) -> None:
        local = self.engine.add_prefilled(request_id, prompt, first_token, params)
        tail = source.num_tokens - (len(source.block_ids) - 1) * self.engine.blocks.block_size
        try:
            self._transfers[request_id] = self.agent.start_read(
                source.peer, source.block_ids, local, notify=source.lease_id.encode(),
                last_block_bytes=tail * self.engine.cache_spec.bytes_per_token)
        except BaseException:
            self.engine.abort(request_id)
            raise

    def _poll_transfers(self) -> None:
        for request_id, handle in list(self._transfers.items()):
            state = self.agent.poll(handle)
            if not state.is_terminal:
                continue
            del self._transfers[request_id]
            if state is TransferState.DONE:
                self.engine.kv_ready(request_id)
                self._push(request_id, KVArrived(handle.nbytes, handle.finished_at - handle.started_at))
            else:
                self.engine.abort(request_id)
                self._push(request_id, TransferFailed(f"KV transfer {state.name.lower()}: {handle.error}"))

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        for o in outputs:
            self._push(o.request_id, o)

    def _push(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, queue = stream
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def _cancel(self, request_id: str) -> bool:
        handle = self._transfers.pop(request_id, None)
        if handle is not None:
            self.agent.abort(handle)
        return self.engine.abort(request_id)
