"""The controller as a detached, named Ray actor: what ``pdserve serve --address`` runs.

On a Ray cluster that pdserve joins, the controller (``LocalCluster``: the supervisor, the
autoscaler, membership) runs in an actor of its own, named ``controller`` in the cluster's Ray
namespace (``--cluster-name``), and every router and worker actor and placement group it makes
is detached and named too. So:

- the ``pdserve serve`` process that started it may exit or die: the cluster keeps serving, and
  ``pdserve serve --address`` run again attaches to it (``pdserve stop`` ends it);
- the controller's own process may die: Ray starts it again, and the new one takes the running
  router and workers over from their own description (``LocalCluster.adopt``), with no model
  load, and goes on supervising and scaling them.

A Ray that ``pdserve serve`` starts itself (no ``--address``) ends with that process, so there
the controller stays in it (``pdserve.cluster.cli``).
"""

from __future__ import annotations

import logging
import os

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.local import LocalCluster
from pdserve.wire.logs import configure

log = logging.getLogger(__name__)

CONTROLLER_NAME = "controller"


@ray.remote(num_cpus=0, max_restarts=-1)
class Controller:
    """One cluster's controller. Ray restarts it, with the config it was created with, whenever
    its process dies."""

    def __init__(self, config: ClusterConfig):
        configure(config.log, "controller")
        self.cluster = LocalCluster(config, detached=True)
        self.adopted = self.cluster.adopt()
        if self.adopted:
            log.warning("controller (re)started: took over the running router at %s and %d prefill + %d decode "
                        "worker(s)", self.cluster.address, len(self.cluster.prefill), len(self.cluster.decode))

    def start(self) -> dict:
        """Start the cluster unless it runs already; returns ``status()``."""
        with self.cluster.lock:
            if self.cluster.router is None:
                self.cluster.start()
        return self.status()

    def config(self) -> ClusterConfig:
        """The cluster's settings, without its secrets: any Ray client may call this."""
        return self.cluster.config.without_secrets()

    def status(self) -> dict:
        """The endpoints, and every process the cluster runs (for ``pdserve status``)."""
        c = self.cluster
        with c.lock:
            workers = {role: [(actor, address, c.role_of(address)) for actor, address in zip(c.actors(role), c.addresses(role))]
                       for role in ("prefill", "decode")}
            router = c.router
        return {
            "grpc_address": c.address, "http_address": c.http_address, "admin_address": c.admin_address,
            "controller_pid": os.getpid(), "adopted": self.adopted,
            "router_pid": _pid(router),
            **{role: [{"address": address, "pid": _pid(actor), "role": held} for actor, address, held in pairs]
               for role, pairs in workers.items()},
        }

    def drain(self, grace_s: float) -> int:
        return self.cluster.drain(grace_s)

    def rollout(self, pool: str | None, drain_grace_s: float, verify_kv: bool | None = None) -> list[dict]:
        """Replace every process of ``pool`` in turn (``pdserve.cluster.rollout``); with
        ``verify_kv`` (no pool), every worker, to that ``verify_kv_transfers`` (``roll_verify``).
        One record per process replaced."""
        import dataclasses

        from pdserve.cluster.rollout import RolloutConfig, roll, roll_verify

        config = RolloutConfig(drain_grace_s=drain_grace_s)
        done = roll(self.cluster, pool, config) if verify_kv is None else roll_verify(self.cluster, verify_kv, config)
        return [dataclasses.asdict(r) for r in done]

    def set_role(self, address: str, role: str, drain_grace_s: float, reason: str) -> dict:
        """Switch the elastic worker at ``address`` to ``role`` in place (``pdserve.cluster.roles``)."""
        import dataclasses

        return dataclasses.asdict(self.cluster.set_role(address, role, drain_grace_s, reason))

    def shutdown(self) -> None:
        """Stop the router and every worker, remove their placement groups, and end this actor
        for good (Ray does not start it again)."""
        self.cluster.stop()
        ray.actor.exit_actor()


def _pid(actor) -> int | None:
    try:
        return ray.get(actor.pid.remote(), timeout=10)
    except Exception:  # dead, or being replaced
        return None


def connect(address: str, namespace: str) -> None:
    """Join the Ray at ``address`` as a driver of the cluster's namespace."""
    if not ray.is_initialized():
        ray.init(address=address, namespace=namespace, include_dashboard=False, logging_level=logging.WARNING)


def get_or_create(config: ClusterConfig):
    """The namespace's controller: the running one, or a new one on this (the driver's) node,
    where the router will serve. Returns (handle, whether it already ran)."""
    try:
        return ray.get_actor(CONTROLLER_NAME), True
    except ValueError:
        pass
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    handle = Controller.options(name=CONTROLLER_NAME, lifetime="detached", get_if_exists=True,
                                scheduling_strategy=here).remote(config)
    return handle, False


def find():
    """The namespace's running controller, or None."""
    try:
        return ray.get_actor(CONTROLLER_NAME)
    except ValueError:
        return None
