"""gRPC face of the decode worker (``pdserve.v1.DecodeWorker``)."""

from __future__ import annotations

import asyncio

import grpc

from decode_worker.worker import DecodeWorker, KVArrived, KVSource, TransferFailed
from engine.errors import CacheCapacityError, InvalidRequestError
from kv_transfer import TransferError
from protos import worker_pb2, worker_pb2_grpc
from wire.convert import finish_to_wire, sampling_from_proto
from wire.grpc_util import abort_invalid, aio_channel
from wire.stats import worker_stats


class DecodeService(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, worker: DecodeWorker, metrics_address: str = ""):
        self.worker = worker
        self.metrics_address = metrics_address
        self._peers: dict[str, str] = {}  # prefill address -> peer agent name
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._lock = asyncio.Lock()

    def _stub(self, address: str) -> worker_pb2_grpc.PrefillWorkerStub:
        if address not in self._channels:
            self._channels[address] = aio_channel(address, self.worker.config.tls)
        return worker_pb2_grpc.PrefillWorkerStub(self._channels[address])

    async def _peer(self, address: str) -> str:
        """The prefill worker's agent, added once per peer (metadata travels over gRPC)."""
        async with self._lock:
            if address not in self._peers:
                meta = await self._stub(address).GetAgentMetadata(worker_pb2.AgentMetadataRequest(), timeout=10)
                self._peers[address] = await asyncio.to_thread(self.worker.add_peer, meta)
            return self._peers[address]

    async def Decode(self, request, context):
        if self.worker.draining:  # the router offers the same KV to another decode worker
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"decode worker {self.worker.config.worker_id} is draining")
        kv = request.kv
        params = sampling_from_proto(request.sampling, keep_stop_strings=False)
        try:
            peer = await self._peer(kv.prefill_address)
        except (grpc.aio.AioRpcError, TransferError) as exc:
            self.worker.source_unreachable()
            reason = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"kv transfer failed: prefill worker {kv.prefill_address} unreachable ({reason})")
        source = KVSource(peer, list(kv.block_ids), kv.num_tokens, kv.lease_id)
        stream = self.worker.decode(request.request_id, list(request.prompt_token_ids), request.first_token_id,
                                    params, source)
        try:
            async for item in stream:
                if isinstance(item, KVArrived):
                    yield worker_pb2.DecodeResponse(kv_bytes=item.nbytes, kv_transfer_seconds=item.seconds)
                    continue
                yield worker_pb2.DecodeResponse(
                    token_ids=item.new_token_ids, logprobs=item.new_logprobs,
                    finish_reason=finish_to_wire(item.finish_reason if item.finished else None))
        except InvalidRequestError as exc:
            await self._release(kv, "aborted")
            await abort_invalid(context, exc)
        except CacheCapacityError as exc:
            await self._release(kv, "aborted")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"decode worker KV cache full: {exc}")
        except TransferFailed as exc:
            await self._release(kv, "transfer_failed")
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"kv transfer failed: {exc}")
        finally:
            await stream.aclose()

    async def _release(self, kv, reason: str) -> None:
        """Tell the prefill worker to free its copy now rather than at lease expiry (best effort)."""
        try:
            await self._stub(kv.prefill_address).Release(
                worker_pb2.ReleaseRequest(lease_id=kv.lease_id, reason=reason), timeout=5)
        except grpc.aio.AioRpcError:
            pass  # the prefill worker is gone, or its lease will expire

    async def Abort(self, request, context):
        return worker_pb2.WorkerAbortResponse(found=await self.worker.abort(request.request_id))

    async def Stats(self, request, context):
        return decode_stats(self.worker, self.metrics_address)

    async def Drain(self, request, context):
        self.worker.draining = True
        return decode_stats(self.worker, self.metrics_address)


def decode_stats(worker: DecodeWorker, metrics_address: str = "") -> worker_pb2.WorkerStats:
    """The worker's ``WorkerStats``: for the router's polls and the worker's /metrics."""
    return worker_stats(worker.config.worker_id, "decode", worker.engine, worker.agent, metrics_address,
                        draining=worker.draining)


def add_to_server(server: grpc.aio.Server, worker: DecodeWorker, metrics_address: str = "") -> None:
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(DecodeService(worker, metrics_address), server)
