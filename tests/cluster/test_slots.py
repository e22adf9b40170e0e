"""The controller's slot bookkeeping (pdserve.cluster.slots): each pool's actors, addresses,
placement groups and specs stay in step through additions, removals, refills and role
switches, and the mixed role follows its worker. Plain values stand in for Ray's actors and
placement groups: the bookkeeping never calls them."""

from dataclasses import dataclass

import pytest

from pdserve.cluster.slots import Slot, Slots


@dataclass(frozen=True)
class ElasticConfig:  # an elastic worker's config: the one kind with a role
    worker_id: str
    role: str


def spec(worker_id: str, role: str | None = None) -> tuple:
    return ("placement", ElasticConfig(worker_id, role) if role else worker_id, 1)


def filled() -> Slots:
    slots = Slots()
    for pool, n in (("prefill", 2), ("decode", 3)):
        for i in range(n):
            assert slots.add(pool, f"actor-{pool}-{i}", f"group-{pool}-{i}", spec(f"{pool}-{i}"), f"{pool}:{i}") == i
    return slots


def test_a_slot_dropped_from_the_middle_takes_its_own_actor_group_and_spec_and_the_rest_move_down():
    slots = filled()
    dropped = slots.drop("decode", 1)
    assert dropped == Slot("actor-decode-1", "decode:1", "group-decode-1", spec("decode-1"))
    assert slots.actors["decode"] == ["actor-decode-0", "actor-decode-2"]
    assert slots.addresses["decode"] == ["decode:0", "decode:2"]
    assert [slots.group("decode", i) for i in range(2)] == ["group-decode-0", "group-decode-2"]
    assert [slots.spec("decode", i) for i in range(2)] == [spec("decode-0"), spec("decode-2")]
    assert sorted(slots.groups()) == sorted(["group-prefill-0", "group-prefill-1", "group-decode-0", "group-decode-2"])


def test_the_lists_the_cluster_shows_stay_the_same_objects():
    slots = Slots()
    shown = slots.actors["prefill"], slots.addresses["prefill"]
    slots.add("prefill", "a", "g", spec("prefill-0"), "p:0")
    slots.drop("prefill", 0)
    slots.add("prefill", "b", "g", spec("prefill-1"), "p:1")
    assert shown == (slots.actors["prefill"], slots.addresses["prefill"]) and shown[0] == ["b"]


def test_a_switch_moves_the_slot_and_records_the_role_its_replacement_starts_in():
    slots = Slots()
    slots.add("prefill", "a", "g", spec("w-0", "prefill"), "w:0")
    slots.add("decode", "b", "h", spec("w-1", "decode"), "w:1")
    slots.put("mixed", slots.take("prefill", "w:0"))
    assert slots.addresses == {"prefill": [], "decode": ["w:1", "w:0"]}
    assert slots.role_of("w:0") == "mixed" and slots.role_of("w:1") == "decode"
    assert slots.spec("decode", 1)[1].role == "mixed" and slots.group("decode", 1) == "g"
    assert slots.members() == [("decode", "w:1"), ("mixed", "w:0")]
    assert slots.members(exclude={"w:1"}) == [("mixed", "w:0")]
    slots.put("prefill", slots.take("mixed", "w:0"))
    assert slots.mixed == set() and slots.role_of("w:0") == "prefill"
    with pytest.raises(ValueError, match="no worker"):
        slots.role_of("w:9")


def test_a_refilled_mixed_slot_stays_mixed_under_its_new_address():
    slots = Slots()
    slots.add("decode", "a", "g", spec("w-0", "mixed"), "w:0")
    slots.mixed.add("w:0")
    slots.refill("decode", 0, "a2", "g2", spec("w-0", "mixed"), "w:5")
    assert slots.mixed == {"w:5"} and slots.actors["decode"] == ["a2"] and slots.group("decode", 0) == "g2"
    assert slots.drop("decode", 0).address == "w:5" and slots.mixed == set()
