"""gRPC face of the elastic worker's own RPC (``pdserve.v1.ElasticWorker``): ``SetRole``. Its
two roles answer ``pdserve.v1.PrefillWorker`` and ``pdserve.v1.DecodeWorker`` on the same server,
each through its own package's service."""

from __future__ import annotations

import grpc

from pdserve.elastic_worker.roles import ROLES
from pdserve.elastic_worker.worker import ElasticWorker
from pdserve.protos import worker_pb2_grpc


class ElasticService(worker_pb2_grpc.ElasticWorkerServicer):
    def __init__(self, worker: ElasticWorker):
        self.worker = worker

    async def SetRole(self, request, context):
        if request.role not in ROLES:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"role must be one of {', '.join(ROLES)}, "
                                f"got {request.role!r}")
        if request.grace_s < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"grace_s must be >= 0, got {request.grace_s}")
        switched = await self.worker.set_role(request.role, request.grace_s, request.reason)
        return switched.to_proto()
