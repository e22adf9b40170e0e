"""Changing an elastic worker's role in place (``pdserve.elastic_worker``): the controller's
half of the switch. The worker keeps its process, weights and KV cache; only the pool the
router lists it in changes, and the router never sends it work its role cannot take:

1. Decide: take the worker out of its old pool's slots and push the membership, so the
   router stops routing to it under its old role (its calls already running carry on).
2. ``SetRole`` on the worker: its old role closes (what still arrives is refused as by a
   draining worker, and the router tries another), what it runs finishes within the grace
   (held KV is pulled or its lease ends; decode streams still running at the grace's end are
   handed over, with their KV where it is whole, and the router moves them to another decode
   worker, or re-prefills them), then its new role opens.
3. Put the worker in the new pool's slots and push the membership with the switch's record
   (``Membership.role_changes``): the router lists it under its new role and counts the
   switch in ``pdserve:role_changes_total`` and ``pdserve:role_switch_seconds`` (decision to
   this push).

A switch between decode and mixed keeps the same core open (``pdserve.elastic_worker.roles``):
nothing is drained and the worker stays listed throughout; ``SetRole`` records the new role and
the one push lists the worker under it. A mixed worker's slot is in the decode pool's list.

A worker whose ``SetRole`` fails goes back to its old pool's slots (it may have closed its old
role: its Stats then say draining, and the router does not route to it).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import grpc
import ray

from pdserve.cluster.settings import DRAIN_GRACE_SECONDS
from pdserve.elastic_worker.roles import CORE, POOL, ROLES
from pdserve.wire.grpc_util import channel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoleSwitch:
    """One switch, as an operator reads it."""

    address: str
    previous: str
    role: str
    reason: str
    seconds: float  # the decision to the router listing the worker in its new pool
    worker_seconds: float  # of which: the worker's own drain and switch (SetRole)
    idle: bool  # the old role finished everything it ran within the grace
    handed_over: int  # decode streams the router migrated because the grace ran out
    leases_left: int  # held KV still served under its lease when the new role opened
    kv_moved: int = 0  # of handed_over: streams that moved with their KV (no re-prefill)


def switch_role(cluster, address: str, role: str, grace_s: float = DRAIN_GRACE_SECONDS.default,
                reason: str = "manual") -> RoleSwitch:
    """Switch the elastic worker at ``address`` of ``cluster`` (a ``LocalCluster`` with
    ``elastic_roles``) to ``role``. Raises ValueError for an unknown role or address, and the
    worker's gRPC error if it would not switch (it is back in its old pool then)."""
    from pdserve.protos import admin_pb2

    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    if grace_s < 0:
        raise ValueError(f"grace_s must be >= 0, got {grace_s}")
    decided = time.monotonic()
    with cluster.lock:
        previous = cluster.role_of(address)
        if previous == role:
            return RoleSwitch(address, previous, role, reason, 0.0, 0.0, True, 0, 0)
        same_core = CORE[previous] == CORE[role]
        if same_core:  # decode <-> mixed: it keeps serving, listed as it was until the switch's push
            pool = POOL[previous]
            actor = cluster.actors(pool)[cluster.addresses(pool).index(address)]
        else:
            slot = cluster.slots.take(previous, address)
            actor = slot.actor
            cluster.push_membership()
    try:
        answer = _set_role(cluster, address, role, grace_s, reason)
    except grpc.RpcError:
        log.exception("worker %s did not switch from %s to %s; it goes back to the %s pool", address, previous,
                      role, previous)
        with cluster.lock:
            if not same_core:
                cluster.slots.put(previous, slot)
                cluster.push_membership()
        raise
    try:  # the actor's own record of its role, for a controller that adopts it later
        ray.get(actor.retag.remote(role), timeout=10)
    except Exception as exc:  # noqa: BLE001 - the switch stands; only a later adoption would misfile it
        log.warning("worker %s switched to %s but its actor did not record it: %s", address, role, exc)
    with cluster.lock:
        if same_core:
            slot = cluster.slots.take(previous, address)
        cluster.slots.put(role, slot)
        seconds = time.monotonic() - decided
        cluster.push_membership(role_changes=[admin_pb2.RoleChange(
            address=address, from_role=previous, to_role=role, reason=reason, seconds=seconds,
            handed_over=answer.handed_over, leases_left=answer.leases_left, kv_moved=answer.kv_moved)])
    done = RoleSwitch(address, previous, role, reason, time.monotonic() - decided, answer.seconds, answer.idle,
                      answer.handed_over, answer.leases_left, answer.kv_moved)
    log.info("worker %s: %s -> %s (%s) in %.3f s (the worker's own part %.3f s%s)", address, previous, role, reason,
             done.seconds, done.worker_seconds, "" if done.idle else
             f"; past the grace {done.handed_over} stream(s) migrated, {done.kv_moved} with their KV")
    return done


def hand_over_to_retire(cluster, address: str, grace_s: float) -> str:
    """Before the controller drains an elastic decode or mixed worker out of ``cluster``
    (``LocalCluster.retire``: scale-down, rollout), whose slot is already gone: its streams get
    ``grace_s`` to finish, and those still running move with their KV to the rest of the decode
    pool, as past a switch's grace (``SetRole`` to prefill), instead of running into the drain's
    end and being re-prefilled. The worker then holds their KV under leases as a prefill worker
    does, and the drain waits until it is read. Returns the role to drain the worker as:
    ``prefill``, or ``decode`` where the worker would not switch (its streams then finish or are
    cut at the drain's end, as a plain decode worker's)."""
    try:
        answer = _set_role(cluster, address, "prefill", grace_s, "retire")
    except grpc.RpcError as exc:
        log.warning("worker %s did not hand its streams over before retiring (%s); draining it as a decode worker",
                    address, exc.details() if hasattr(exc, "details") else exc)
        return "decode"
    log.info("worker %s retires: %d stream(s) still running after %.1f s handed over, %d with their KV", address,
             answer.handed_over, grace_s, answer.kv_moved)
    return "prefill"


def _set_role(cluster, address: str, role: str, grace_s: float, reason: str):
    """The worker's ``SetRole`` RPC; its ``SetRoleResponse``, or the gRPC error."""
    from pdserve.protos import worker_pb2, worker_pb2_grpc

    with channel(address, cluster.config.tls_for("controller"), peer=POOL[role]) as ch:
        return worker_pb2_grpc.ElasticWorkerStub(ch).SetRole(
            worker_pb2.SetRoleRequest(role=role, grace_s=grace_s, reason=reason), timeout=grace_s + 30)
