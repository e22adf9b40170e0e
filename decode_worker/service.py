"""gRPC face of the decode worker (``pdserve.v1.DecodeWorker``)."""

from __future__ import annotations

import asyncio

import grpc

from decode_worker.worker import DecodeWorker, KVArrived, KVSource, TransferFailed
from engine.errors import CacheCapacityError, InvalidRequestError, StepFailed
from kv_transfer import TransferError
from protos import worker_pb2, worker_pb2_grpc
from wire.convert import finish_to_wire, sampling_from_proto
from wire.failure import Failure, abort_with
from wire.grpc_util import abort_invalid, aio_channel
from wire.worker_shell import ShellRpcs


class DecodeService(ShellRpcs, worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, worker: DecodeWorker, metrics_address: str = ""):
        self.worker = worker
        self.metrics_address = metrics_address
        self._peers: dict[str, str] = {}  # prefill address -> peer agent name
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._lock = asyncio.Lock()

    def _stub(self, address: str) -> worker_pb2_grpc.PrefillWorkerStub:
        if address not in self._channels:
            self._channels[address] = aio_channel(address)
        return worker_pb2_grpc.PrefillWorkerStub(self._channels[address])

    async def _peer(self, address: str) -> str:
        """The prefill worker's agent, added once per peer (metadata travels over gRPC)."""
        async with self._lock:
            if address not in self._peers:
                meta = await self._stub(address).GetAgentMetadata(worker_pb2.AgentMetadataRequest(), timeout=10)
                self._peers[address] = await asyncio.to_thread(self.worker.add_peer, meta)
            return self._peers[address]

    async def Decode(self, request, context):
        # The router offers the same KV to another decode worker.
        await self.refuse_if_draining(context, grpc.StatusCode.RESOURCE_EXHAUSTED)
        kv = request.kv
        params = sampling_from_proto(request.sampling, keep_stop_strings=False)
        try:
            peer = await self._peer(kv.prefill_address)
        except (grpc.aio.AioRpcError, TransferError) as exc:
            self.worker.source_unreachable()
            reason = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            await abort_with(context, grpc.StatusCode.UNAVAILABLE, Failure.KV_TRANSFER,
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
            await abort_with(context, grpc.StatusCode.UNAVAILABLE, Failure.KV_TRANSFER, f"kv transfer failed: {exc}")
        except StepFailed as exc:
            await abort_with(context, grpc.StatusCode.ABORTED, Failure.STEP_FAILED, str(exc))
        finally:
            await stream.aclose()

    async def _release(self, kv, reason: str) -> None:
        """Tell the prefill worker to free its copy now rather than at lease expiry (best effort)."""
        try:
            await self._stub(kv.prefill_address).Release(
                worker_pb2.ReleaseRequest(lease_id=kv.lease_id, reason=reason), timeout=5)
        except grpc.aio.AioRpcError:
            pass  # the prefill worker is gone, or its lease will expire


def add_to_server(server: grpc.aio.Server, worker: DecodeWorker, metrics_address: str = "") -> None:
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(DecodeService(worker, metrics_address), server)
