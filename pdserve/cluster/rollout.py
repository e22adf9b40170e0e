"""Rolling restart of one pool of a cluster on Ray, as ``kubectl rollout restart`` does it for a
Deployment with ``maxSurge: 1, maxUnavailable: 0``: each process of the pool in turn is
replaced by a new one with the same settings, and no request is lost.

For each worker of the pool (prefill or decode), one at a time:

1. Surge: a new worker starts in a slot of its own (the pool's settings, a new id and port).
   It is ready once its server answers; then it joins the router's table, and the rollout
   checks that the router lists it (readiness, and the Service's endpoints).
2. Drain the old one (the preStop hook and SIGTERM): it leaves the router's table, so nothing
   new reaches it, and takes no new request. A prefill worker keeps serving the KV it holds
   until the decode workers have pulled it; a decode worker finishes its streams.
3. Stop it once it is idle, or when ``drain_grace_s`` (terminationGracePeriodSeconds) runs
   out: then its streams migrate (the router re-prefills prompt + tokens sent on a healthy
   pair and the stream goes on), and the KV it still held is released by the router or by its
   lease.

The router (one process) the same way: a new router binds the same public ports (SO_REUSEPORT:
the kernel spreads new connections over both), gets the membership and reports ready; then
the old one hands over (``pdserve.router.handover``): readiness false, ``unready_s`` later it
stops listening and sends its clients' connections GOAWAY, its streams finish within
``drain_grace_s``, and it stops.

A pool's workers are replaced in the order they run; a worker that left meanwhile (the
autoscaler removed it, the supervisor replaced it) is skipped.

A rollout may change one setting on the way: ``verify_kv_transfers`` (``roll_verify``), which is
one setting for the whole cluster. Its workers are replaced pool by pool, each pool's new ones
started with the new setting: turning verification on, the holders (the prefill pool) first,
then the readers (decode); turning it off, the readers first. Meanwhile the router pairs only
a holder and a reader that agree (``pdserve.router.policy.verify_agrees``; with none, the decode
worker prefills the request itself), and a reader that verifies refuses KV without checksums
(``pdserve.kv_transfer.errors.UnverifiedTransfer``) should the router pair them on stale stats.
Holders first makes that race harmless: a restarted holder that now sends checksums to a reader
the router still pairs it with costs nothing; a reader that verifies before its holders do
would refuse their KV and send the request round again.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import ray

from pdserve.cluster.settings import DRAIN_GRACE_SECONDS
from pdserve.wire.grpc_util import channel

log = logging.getLogger(__name__)

POOLS = ("prefill", "decode", "router")
_READY_POLL_S = 0.1


@dataclass(frozen=True)
class RolloutConfig:
    # How long an old process may take to finish what it runs (terminationGracePeriodSeconds,
    # less the margin a pod keeps for its exit).
    drain_grace_s: float = DRAIN_GRACE_SECONDS.default
    # The old router stays unready but serving this long before it stops listening (a preStop
    # sleep). Locally the kernel stops sending it connections the moment it closes its socket.
    unready_s: float = 0.5
    # A replacement not ready within this stops the rollout (progressDeadlineSeconds).
    ready_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        for name in ("drain_grace_s", "unready_s", "ready_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"rollout {name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class Replaced:
    """One process replaced: what an operator reads after a rollout."""

    pool: str
    old: str  # the old process's address (a router: its internal address)
    new: str
    surge_s: float  # from starting the new process until it was ready and registered
    drain_s: float  # from the old one's drain until it stopped
    # It finished everything within the grace. If not, a worker's streams migrated and a
    # router's were cut (the log says how many).
    idle: bool


class RolloutError(RuntimeError):
    """A replacement did not become ready; the old process keeps serving."""


def roll(cluster, pool: str, config: RolloutConfig = RolloutConfig()) -> list[Replaced]:
    """Replace every process of ``pool`` (prefill, decode or router) of ``cluster`` (a
    ``LocalCluster``) in turn. Returns one record per process replaced."""
    if pool not in POOLS:
        raise ValueError(f"pool must be one of {', '.join(POOLS)}, got {pool!r}")
    if pool == "router":
        return [roll_router(cluster, config)]
    with cluster.lock:
        old = list(cluster.addresses(pool))
    return [done for address in old if (done := roll_worker(cluster, pool, address, config)) is not None]


def verify_order(verify: bool) -> tuple[str, str]:
    """The pools a rollout of ``verify_kv_transfers`` replaces, in order: turning it on, the
    holders (prefill) before the readers (decode); turning it off, the other way round."""
    return ("prefill", "decode") if verify else ("decode", "prefill")


def with_verify(config, verify: bool):
    """A worker config (prefill, decode, or an elastic worker's, which holds both) that verifies
    KV transfers or not."""
    if hasattr(config, "verify_kv"):
        return dataclasses.replace(config, verify_kv=verify)
    return dataclasses.replace(config, prefill=with_verify(config.prefill, verify),
                               decode=with_verify(config.decode, verify))


def roll_verify(cluster, verify: bool, config: RolloutConfig = RolloutConfig()) -> list[Replaced]:
    """Turn ``verify_kv_transfers`` on (or off) across ``cluster``: pool by pool in
    ``verify_order``, the pool's next workers get the setting, then each of its workers is
    replaced (``roll``). Returns one record per process replaced."""
    done: list[Replaced] = []
    for pool in verify_order(verify):
        cluster.change_template(pool, lambda c: with_verify(c, verify))
        log.info("rollout: %s workers now start with verify_kv_transfers %s", pool, "on" if verify else "off")
        done += roll(cluster, pool, config)
    return done


def roll_worker(cluster, role: str, address: str, config: RolloutConfig) -> Replaced | None:
    """Replace the ``role`` worker at ``address``; None if it no longer runs."""
    with cluster.lock:
        if address not in cluster.addresses(role):
            return None
    start = time.monotonic()
    new = cluster.scale_up(role)  # ready (it answers) and in the router's table
    _wait_listed(cluster, role, new, start + config.ready_timeout_s)
    surged = time.monotonic()
    idle = cluster.retire(role, address, config.drain_grace_s)
    done = Replaced(role, address, new, surged - start, time.monotonic() - surged, idle is not False)
    log.info("rollout: %s worker %s replaced by %s (ready in %.1f s, drained in %.1f s%s)", role, address, new,
             done.surge_s, done.drain_s, "" if done.idle else ", stopped busy: its requests migrate")
    return done


def _wait_listed(cluster, role: str, address: str, deadline: float) -> None:
    """Until the router's table lists ``address`` (the join is the controller's word, but the
    router answers for itself)."""
    from pdserve.protos import admin_pb2, admin_pb2_grpc

    while True:
        with channel(cluster.admin_address, cluster.config.tls_for("controller"), peer="router") as ch:
            table = admin_pb2_grpc.RouterAdminStub(ch).GetMembership(admin_pb2.Membership(), timeout=10)
        if any(m.role == role and m.address == address for m in table.members):
            return
        if time.monotonic() > deadline:
            raise RolloutError(f"the router does not list the new {role} worker {address}")
        time.sleep(_READY_POLL_S)


def roll_router(cluster, config: RolloutConfig) -> Replaced:
    """Replace the router: the new one serves the same ports before the old one stops."""
    start = time.monotonic()
    old_admin = cluster.admin_address
    old = cluster.surge_router()
    deadline = start + config.ready_timeout_s
    while not ray.get(cluster.router.ready.remote(), timeout=30):
        if time.monotonic() > deadline:
            _abandon_surge(cluster, old, old_admin)
            raise RolloutError("the new router did not become ready; the old one serves on")
        time.sleep(_READY_POLL_S)
    surged = time.monotonic()
    try:
        cut = ray.get(old.hand_over.remote(config.unready_s, config.drain_grace_s),
                      timeout=config.unready_s + config.drain_grace_s + 30)
    finally:
        ray.kill(old, no_restart=True)
    done = Replaced("router", old_admin, cluster.admin_address, surged - start, time.monotonic() - surged, cut == 0)
    log.info("rollout: router replaced (ready in %.1f s, handed over in %.1f s, %d request(s) cut)",
             done.surge_s, done.drain_s, cut)
    return done


def _abandon_surge(cluster, old, old_admin: str) -> None:
    """The new router never became ready: stop it, and the old one is the router again."""
    with cluster.lock:
        new = cluster.router
        cluster.router = old
        cluster.admin_address = old_admin
    try:
        ray.kill(new, no_restart=True)
    except Exception:  # already gone
        pass
    cluster.push_membership()

