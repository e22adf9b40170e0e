"""The RPCs both worker services answer the same way: ``Abort``, ``Stats``, ``Drain``,
``LoadLoRA`` and ``UnloadLoRA``, and the admission check every new request passes (``ShellRpcs``)."""

from __future__ import annotations

import grpc

from pdserve.engine.errors import InvalidRequestError
from pdserve.protos import worker_pb2
from pdserve.shell import lora_rpcs
from pdserve.shell.worker import WorkerShell
from pdserve.wire.grpc_util import abort_invalid


class ShellRpcs:
    """``Abort``, ``Stats`` and ``Drain``, served the same way by both worker services. Put
    it before the generated servicer base, whose methods answer UNIMPLEMENTED."""

    worker: WorkerShell
    metrics_address: str = ""

    async def Abort(self, request, context):
        return worker_pb2.WorkerAbortResponse(found=await self.worker.abort(request.request_id))

    async def Stats(self, request, context):
        """The worker's stats plus, when asked, the prefix-cache events this router has not
        seen yet (a worker that publishes none answers without them)."""
        self.worker.note_poll(request.router_id)
        stats = self.worker.stats(self.metrics_address)
        batch = self.worker.cache_events(request.cache_epoch, request.cache_events_after) if request.cache_events else None
        if batch is not None:
            stats.cache_events.CopyFrom(worker_pb2.CacheEvents(
                epoch=batch.epoch, last_seq=batch.last_seq, snapshot=batch.snapshot, block_hashes=batch.hashes,
                cached=batch.cached, in_tier=batch.in_tier))
        return stats

    async def Drain(self, request, context):
        self.worker.draining = True
        return self.worker.stats(self.metrics_address)

    async def LoadLoRA(self, request, context):
        """Load a PEFT adapter into the engine, between two of its steps (``lora_rpcs.load``);
        a bad one is INVALID_ARGUMENT naming the field and the limit."""
        try:
            loaded, names = await self.worker.call(lora_rpcs.load, self.worker.engine, request.lora_name,
                                                   request.lora_path)
        except InvalidRequestError as exc:
            await abort_invalid(context, exc)
        return worker_pb2.LoadLoRAResponse(loaded=loaded, lora_names=names)

    async def UnloadLoRA(self, request, context):
        """Unload an adapter; INVALID_ARGUMENT naming lora_name while requests here use it (the
        router tries again after a later poll: ``pdserve.router.lora_admin``)."""
        try:
            found, names = await self.worker.call(lora_rpcs.unload, self.worker.engine, request.lora_name)
        except InvalidRequestError as exc:
            await abort_invalid(context, exc)
        return worker_pb2.UnloadLoRAResponse(found=found, lora_names=names)

    async def admit(self, context, draining_code: grpc.StatusCode) -> None:
        """Refuse a new request at once, before any work: ``draining_code`` while the worker
        drains, RESOURCE_EXHAUSTED while it already holds ``max_requests`` (the router tries
        another worker, or answers 429 with Retry-After)."""
        worker = self.worker
        if worker.draining:
            await context.abort(draining_code, f"{worker.role} worker {worker.config.worker_id} {worker.refusal}")
        if worker.requests() >= worker.config.max_requests:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{worker.role} worker {worker.config.worker_id} holds max_requests "
                                f"({worker.config.max_requests}) requests")
