"""A cluster's worker slots (``LocalCluster.slots``): each pool's workers in order, and for each
its actor, its address, its placement group and its spec (what starts again in it), kept in
step: a slot added, taken out or refilled is one call here, whatever the index. A mixed
worker (an elastic worker in the mixed role) has a decode pool's slot, named in ``mixed``.

Plain bookkeeping, no Ray calls: the controller (``pdserve.cluster.local``) starts and stops
the actors, and holds its lock around every change."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pdserve.elastic_worker.roles import POOL

POOLS = ("prefill", "decode")


@dataclass(frozen=True)
class Slot:
    """One worker's slot, as ``take`` hands it out and ``put`` takes it back."""

    actor: object
    address: str
    group: object  # its placement group
    spec: tuple  # (placement, config, threads): what the supervisor starts again in it


class Slots:
    """``actors[pool]`` and ``addresses[pool]`` are the lists the cluster shows as
    ``LocalCluster.prefill``, ``decode``, ``prefill_addresses`` and ``decode_addresses``; the
    same list objects for the cluster's whole life."""

    def __init__(self):
        self.actors: dict[str, list] = {pool: [] for pool in POOLS}
        self.addresses: dict[str, list[str]] = {pool: [] for pool in POOLS}
        self._groups: dict[str, list] = {pool: [] for pool in POOLS}
        self._specs: dict[str, list[tuple]] = {pool: [] for pool in POOLS}
        self.mixed: set[str] = set()  # addresses of mixed workers (their slots are the decode pool's)

    def add(self, pool: str, actor, group, spec: tuple, address: str) -> int:
        """A new last slot of ``pool`` for a worker that serves at ``address``; its index."""
        for column, value in ((self.actors, actor), (self.addresses, address), (self._groups, group),
                              (self._specs, spec)):
            column[pool].append(value)
        return len(self.actors[pool]) - 1

    def refill(self, pool: str, index: int, actor, group, spec: tuple, address: str) -> None:
        """A new worker in the slot at ``index`` (its old one died); a mixed slot stays mixed."""
        dead = self.addresses[pool][index]
        self.actors[pool][index], self._groups[pool][index], self._specs[pool][index] = actor, group, spec
        self.addresses[pool][index] = address
        if dead in self.mixed:  # its spec's config says mixed: the new worker started in it
            self.mixed.discard(dead)
            self.mixed.add(address)

    def group(self, pool: str, index: int):
        return self._groups[pool][index]

    def spec(self, pool: str, index: int) -> tuple:
        return self._specs[pool][index]

    def groups(self) -> list:
        return [g for pool in POOLS for g in self._groups[pool]]

    def drop(self, pool: str, index: int) -> Slot:
        """Take the slot at ``index`` out of ``pool`` (later slots move down one); what it held."""
        slot = Slot(*(column[pool].pop(index) for column in (self.actors, self.addresses, self._groups, self._specs)))
        self.mixed.discard(slot.address)
        return slot

    def role_of(self, address: str) -> str:
        """The role of the worker at ``address``: its pool, or ``mixed``; ValueError if none."""
        for pool in POOLS:
            if address in self.addresses[pool]:
                return "mixed" if address in self.mixed else pool
        raise ValueError(f"no worker of this cluster serves at {address}")

    def take(self, role: str, address: str) -> Slot:
        """Take the worker at ``address`` out of ``role``'s pool, still running (a role switch)."""
        pool = POOL[role]
        return self.drop(pool, self.addresses[pool].index(address))

    def put(self, role: str, slot: Slot) -> None:
        """Put a slot ``take`` took into ``role``'s pool; a replacement the supervisor starts
        there starts in ``role`` (an elastic worker's config records it)."""
        placement, config, threads = slot.spec
        if hasattr(config, "role"):
            config = dataclasses.replace(config, role=role)
        self.add(POOL[role], slot.actor, slot.group, (placement, config, threads), slot.address)
        if role == "mixed":
            self.mixed.add(slot.address)

    def members(self, exclude: set[str] = frozenset()) -> list[tuple[str, str]]:
        """(role, address) of every slot but ``exclude``, as the router's table lists them."""
        return [("mixed" if a in self.mixed else pool, a) for pool in POOLS for a in self.addresses[pool]
                if a not in exclude]
