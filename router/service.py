"""The public ``pdserve.v1.Generation`` service."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator

import grpc

from engine.errors import InvalidRequestError
from planner.trace_writer import TraceWriter
from protos import pdserve_pb2, pdserve_pb2_grpc
from router.frontend import ModelInfo, prepare
from router.orchestrator import RequestRun, RouteError, RouterLimits
from router.pool import WorkerPool
from wire.grpc_util import abort_invalid

log = logging.getLogger(__name__)


class GenerationService(pdserve_pb2_grpc.GenerationServicer):
    def __init__(self, model: ModelInfo, pool: WorkerPool, limits: RouterLimits):
        self.model = model
        self.pool = pool
        self.limits = limits
        self.running: dict[str, tuple[asyncio.Task, RequestRun]] = {}
        self.aborted: set[str] = set()
        self.trace = TraceWriter.from_env()  # planner replay: PDSERVE_TRACE_FILE records lengths per request

    async def run(self, request: pdserve_pb2.GenerateRequest) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
        """One request's responses, for every front (gRPC here, HTTP in http_api.py).

        Raises ``InvalidRequestError`` or ``RouteError``; an ``Abort`` ends the stream with a
        FINISH_REASON_ABORT response, a cancelled caller cleans up on the way out.
        """
        arrived = time.monotonic()  # TTFT and e2e latency include tokenizing and the chat template
        prepared = prepare(request, self.model)
        rid = prepared.request_id
        if rid in self.running:
            raise InvalidRequestError("request_id", f"{rid!r} is already running")
        run = RequestRun(prepared, self.model, self.pool, self.limits, arrived=arrived)
        self.running[rid] = (asyncio.current_task(), run)
        try:
            async for resp in run.responses():
                yield resp
        except asyncio.CancelledError:
            if rid not in self.aborted:
                raise  # the client went away; cleanup ran on the way out
            yield pdserve_pb2.GenerateResponse(request_id=rid, finish_reason=pdserve_pb2.FINISH_REASON_ABORT,
                                               usage=run.usage())
        finally:
            if self.trace is not None:
                self.trace.record(prepared.prompt_token_ids, len(run.progress.token_ids), arrived)
            self.running.pop(rid, None)
            self.aborted.discard(rid)

    async def Generate(self, request, context):
        try:
            async for resp in self.run(request):
                yield resp
        except InvalidRequestError as exc:
            await abort_invalid(context, exc)
        except RouteError as exc:
            await context.abort(exc.code, str(exc))

    async def Abort(self, request, context):
        entry = self.running.get(request.request_id)
        if entry is None:
            return pdserve_pb2.AbortResponse(found=False)
        self.aborted.add(request.request_id)
        entry[0].cancel()
        return pdserve_pb2.AbortResponse(found=True)

    async def ListModels(self, request, context):
        return pdserve_pb2.ListModelsResponse(models=[pdserve_pb2.ModelInfo(
            id=self.model.name, max_model_len=self.model.max_model_len, vocab_size=self.model.config.vocab_size)])
