"""``pdserve.v1.RouterAdmin``: how the controller sets the router's membership and reads the
latencies its autoscaler weighs against the SLOs, and how a plain-process worker adds itself
to the table and takes itself out.

Who may call what is ``pdserve.wire.internal_plane.ALLOWED``: only the controller replaces the
table (``SetMembership``); a worker's ``Join`` and ``Leave`` change one member, of a role its
certificate holds, so a decode worker's certificate can list no prefill worker and drop none.
"""

from __future__ import annotations

import grpc

from pdserve.protos import admin_pb2, admin_pb2_grpc
from pdserve.router.pool import WorkerPool
from pdserve.wire import metrics
from pdserve.wire.internal_plane import peer_roles

JOIN_ROLES = ("prefill", "decode")  # the roles a worker joins as; mixed and elastic ones are the controller's


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

    async def Join(self, request, context):
        await _check_member(request, context)
        members = self.pool.members()
        if (request.role, request.address) in members:
            return admin_pb2.JoinAck(changed=False)
        await self.pool.set_members([m for m in members if m[1] != request.address] + [(request.role, request.address)])
        return admin_pb2.JoinAck(changed=True)

    async def Leave(self, request, context):
        await _check_member(request, context)
        members = self.pool.members()
        if (request.role, request.address) not in members:
            return admin_pb2.JoinAck(changed=False)
        await self.pool.set_members([m for m in members if m != (request.role, request.address)])
        return admin_pb2.JoinAck(changed=True)

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


async def _check_member(member: admin_pb2.Member, context) -> None:
    """A worker joins or leaves as a prefill or decode worker at an address, and only under a
    role its certificate holds (without mTLS, where roles cannot be told apart: any)."""
    if member.role not in JOIN_ROLES:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"role: must be one of {', '.join(JOIN_ROLES)}, got {member.role!r}")
    if not member.address:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "address: must be the worker's host:port")
    roles = peer_roles(context)
    if roles is not None and member.role not in roles:
        held = ", ".join(sorted(roles)) or "none"
        await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                            f"a worker joins or leaves only as a role its certificate names ({held}), "
                            f"not {member.role!r}")
