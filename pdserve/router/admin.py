"""``pdserve.v1.RouterAdmin``: how the controller sets the router's membership and reads the
latencies its autoscaler weighs against the SLOs."""

from __future__ import annotations

from pdserve.protos import admin_pb2, admin_pb2_grpc
from pdserve.router.pool import WorkerPool
from pdserve.wire import metrics


class RouterAdminService(admin_pb2_grpc.RouterAdminServicer):
    def __init__(self, pool: WorkerPool):
        self.pool = pool

    async def SetMembership(self, request, context):
        self.pool.desired_replicas.update(request.desired_replicas)
        self.pool.signal_targets.update(request.signal_targets)
        await self.pool.set_members([(m.role, m.address) for m in request.members])
        for change in request.role_changes:  # the worker is in its new pool from here on
            metrics.role_changed(change.from_role, change.to_role, change.reason or "unspecified", change.seconds,
                                 change.handed_over, change.leases_left, change.kv_moved)
        metrics.set_budget_pressure(dict(request.budget_pressure))
        roles = [role for role, _ in self.pool.members()]
        return admin_pb2.MembershipAck(prefill_workers=roles.count("prefill"),
                                       decode_workers=roles.count("decode") + roles.count("mixed"))

    async def GetMembership(self, request, context):
        return admin_pb2.Membership(members=[admin_pb2.Member(role=r, address=a) for r, a in self.pool.members()])

    async def GetLatency(self, request, context):
        summary = admin_pb2.LatencySummary()
        ttft, summary.ttft_count = metrics.RECENT_TTFT.quantile(0.9, request.window_s)
        itl, summary.itl_count = metrics.RECENT_ITL.quantile(0.9, request.window_s)
        if ttft is not None:
            summary.ttft_p90_s = ttft
        if itl is not None:
            summary.itl_p90_s = itl
        return summary
