"""Where each worker runs: one Ray placement group per worker, with what its pool asks for.

A pool asks for what one worker really uses: its CPUs (the torch threads it runs), its GPUs,
its memory, and one unit of a custom resource that only the nodes of its node group offer
(``ray start --resources '{"pdserve_decode": 4}'``: that node hosts up to 4 decode workers).
The custom resource pins the pool to those nodes, so prefill and decode land on hardware sized
for each. A worker that no node can hold keeps its placement group pending: that demand is
what makes Ray's autoscaler (or KubeRay's) add a node of the group offering the resource, and
``reserve`` waits for it.

A tensor-parallel worker of N ranks gets N bundles in its group, one per rank, on one node
(``STRICT_PACK``): the worker's CPUs, memory and custom resource are split evenly over them, and
``gpus`` is each rank's. Rank 0 is the worker's actor, in bundle 0; it starts the other ranks
as its own processes (``pdserve.engine.distributed.group``), which use what bundles 1..N-1 reserve.
The GPUs are the exception: bundle 0 reserves every rank's (``bundles``), so that rank 0's actor
sees them all (Ray sets its ``CUDA_VISIBLE_DEVICES``) and so do the ranks it starts, which inherit
it: rank r computes on device r of those (``distributed.group.rank_device``).

GPUs may be shared: ``gpus`` below 1 reserves a fraction of one device (Ray's fractional
GPUs), so one GPU holds a prefill and a decode worker at 0.5 each. Ray then hands both the
same device (``CUDA_VISIBLE_DEVICES``); it does not divide the device's memory: each worker
takes its own share of it (``gpu_memory_utilization``), or an exact KV cache size that leaves
room for the other. Above 1, Ray takes only
whole GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

@dataclass(frozen=True)
class PoolPlacement:
    # Logical CPUs reserved per worker. Tiny by default: on a small CPU box several workers
    # share the cores (their torch thread count is set separately), and Ray must not refuse
    # to place the fourth worker on a 2-core machine.
    cpus: float = 0.01
    gpus: float = 0.0  # 1 on GPU hosts: each worker owns a device; 0.5: two workers share one
    memory_bytes: int = 0  # host memory reserved per worker (weights, KV cache on CPU); 0: none
    resource: str | None = None  # custom resource naming this pool's node group (pdserve_prefill, ...)
    # Units of ``resource`` per worker: a node offering N hosts N of this pool's workers.
    resource_units: float = 1.0
    ranks: int = 1  # tensor-parallel ranks per worker: a bundle each, on one node

    def __post_init__(self) -> None:
        if self.gpus < 0 or (self.gpus > 1 and not float(self.gpus).is_integer()):
            raise ValueError(f"gpus_per_worker must be a fraction of one GPU (at most 1) or a whole number of "
                             f"GPUs, got {self.gpus:g}")
        if self.ranks < 1:
            raise ValueError(f"a worker has at least one rank, got {self.ranks}")
        if self.worker_gpus > 1 and not float(self.worker_gpus).is_integer():
            raise ValueError(f"gpus_per_worker x tensor-parallel size must be at most 1 or a whole number of GPUs "
                             f"(a worker's ranks take them together), got {self.gpus:g} x {self.ranks}")

    def bundles(self) -> list[dict[str, float]]:
        """The worker's bundles, a rank each: bundle 0 holds every rank's GPUs (module docstring)."""
        first = self.bundle()
        if not self.gpus or self.ranks == 1:
            return [first] * self.ranks
        rest = {k: v for k, v in first.items() if k != "GPU"}
        return [{**first, "GPU": self.worker_gpus}] + [rest] * (self.ranks - 1)

    @property
    def worker_gpus(self) -> float:
        """The GPUs rank 0's actor takes: every rank's."""
        return self.gpus * self.ranks

    def bundle(self) -> dict[str, float]:
        """One rank's bundle: its share of the worker's CPUs, memory and resource, its GPUs."""
        out = {"CPU": self.cpus / self.ranks}
        if self.gpus:
            out["GPU"] = self.gpus
        if self.memory_bytes:
            out["memory"] = self.memory_bytes // self.ranks
        if self.resource:
            out[self.resource] = self.resource_units / self.ranks
        return out


class PlacementTimeout(RuntimeError):
    """No node could hold a worker's bundle in time; names the pool and the bundle."""


def reserve(placement: PoolPlacement, name: str, timeout_s: float = 300.0, detached: bool = False):
    """Create the worker's placement group and wait until Ray has reserved it. A detached group
    outlives the process that made it (the controller actor, when that restarts).

    Returns (placement group, actor options that schedule into it and use its resources).
    """
    bundle = placement.bundle()
    pg = placement_group(placement.bundles(), strategy="STRICT_PACK", name=name,
                         lifetime="detached" if detached else None)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise PlacementTimeout(f"{name}: no Ray node offered {bundle} within {timeout_s:.0f} s "
                               f"(is a node with resource {placement.resource!r} in the cluster?)")
    return pg, actor_options(placement, pg)


def actor_options(placement: PoolPlacement, pg) -> dict:
    """Ray actor options that schedule a worker (its rank 0) into bundle 0 of its placement
    group ``pg`` and use what that bundle reserved (a fractional ``num_gpus`` included, and
    every rank's GPUs)."""
    bundle = placement.bundle()
    options = {
        "scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=0),
        "num_cpus": bundle["CPU"],
        "num_gpus": placement.worker_gpus,
        "resources": {placement.resource: bundle[placement.resource]} if placement.resource else {},
    }
    if placement.memory_bytes:
        options["memory"] = bundle["memory"]
    return options


def remove(pg) -> None:
    """Remove a placement group (Ray's word), which kills the actors in it."""
    try:
        remove_placement_group(pg)
    except Exception:  # already gone with its cluster
        pass


def remove_orphan_groups(prefix: str, kept: set[str]) -> None:
    """Remove the placement groups whose names begin with ``prefix`` (one cluster's) and whose
    ids (hex) are not in ``kept``: a restarted controller's sweep of the groups whose worker
    died while no controller watched."""
    from ray.util.placement_group import PlacementGroup, placement_group_table

    for pg_id, info in placement_group_table().items():
        if info.get("name", "").startswith(prefix) and info.get("state") != "REMOVED" and pg_id not in kept:
            remove(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))
