"""Lease bookkeeping: expiry order, early release, no double release."""

from prefill_worker.leases import Lease, LeaseTable


def test_expired_leases_come_out_once_in_deadline_order():
    t = LeaseTable()
    for lid, at in (("b", 2.0), ("a", 1.0), ("c", 3.0)):
        t.add(Lease(lid, f"req-{lid}", at))
    assert [l.lease_id for l in t.pop_expired(2.5)] == ["a", "b"]
    assert t.pop_expired(2.5) == [] and len(t) == 1 and t.expired_total == 2


def test_released_lease_never_expires_later():
    t = LeaseTable()
    t.add(Lease("a", "r", 1.0))
    assert t.pop("a").request_id == "r"
    assert t.pop("a") is None
    assert t.pop_expired(10.0) == [] and t.expired_total == 0
