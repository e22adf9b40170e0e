"""``pdserve.v1.RouterAdmin``: how the controller sets the router's membership and reads the
latencies its autoscaler weighs against the SLOs, and how a plain-process worker adds itself
to the table and takes itself out.

Who may call what is ``pdserve.wire.internal_plane.ALLOWED``: only the controller replaces the
table (``SetMembership``, which is how it replaces, moves and switches the role of workers). A
worker's ``Join`` and ``Leave`` change one member, itself: under mTLS, of a role its
certificate holds, and at an address whose host its certificate names (an IP or DNS SAN,
``pdserve.wire.tls.certificate_hosts``); a ``Join`` never drops a member listed at that address
under a role the caller does not hold. So no worker can add, move or drop another: a decode
worker's certificate lists no prefill worker, drops none, and leaves no other decode worker's
entry. Each refusal is PERMISSION_DENIED naming what the certificate holds, and leaves the
table as it was. Without mTLS (loopback, or insecure by choice) callers cannot be told apart
and none of this is checked.
"""

from __future__ import annotations

import grpc

from pdserve.protos import admin_pb2, admin_pb2_grpc
from pdserve.router.pool import WorkerPool
from pdserve.wire import metrics
from pdserve.wire.internal_plane import peer_certificate, peer_roles
from pdserve.wire.tls import certificate_hosts, names_host

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
        roles = await _check_member(request, context)
        members = self.pool.members()
        if (request.role, request.address) in members:
            return admin_pb2.JoinAck(changed=False)
        listed = sorted({role for role, address in members if address == request.address})
        if roles is not None and not set(listed) <= roles:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"address: {request.address} is listed as a {', '.join(listed)} worker; a worker "
                                f"replaces no member of a role its certificate does not name "
                                f"({', '.join(sorted(roles))})")
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


async def _check_member(member: admin_pb2.Member, context) -> frozenset[str] | None:
    """A worker joins or leaves as a prefill or decode worker at a ``host:port``, and only as
    itself: under a role its certificate holds, at a host it names. The caller's roles; None
    without mTLS, where callers cannot be told apart and neither is checked."""
    if member.role not in JOIN_ROLES:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"role: must be one of {', '.join(JOIN_ROLES)}, got {member.role!r}")
    host, _, port = member.address.rpartition(":")
    if not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"address: must be the worker's host:port (port 1-65535), got {member.address!r}")
    roles = peer_roles(context)
    if roles is None:
        return None
    if member.role not in roles:
        held = ", ".join(sorted(roles)) or "none"
        await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                            f"a worker joins or leaves only as a role its certificate names ({held}), "
                            f"not {member.role!r}")
    pem = peer_certificate(context) or b""
    if not names_host(pem, host):
        hosts = ", ".join(sorted(certificate_hosts(pem))) or "no host"
        await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                            f"address: a worker joins or leaves only at its own address, a host its certificate "
                            f"names (IP or DNS SAN); it names {hosts}, not {host.strip('[]')} of {member.address} "
                            f"(issue one per worker: python -m pdserve.cluster.certs DIR --worker NAME=ROLE@HOST)")
    return roles
