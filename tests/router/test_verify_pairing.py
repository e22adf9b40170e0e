"""The router pairs a KV holder and reader only when both verify KV or neither does
(``verify_kv_transfers``, one setting for the whole cluster, differs only halfway through a
rollout that changes it): the pure rule (``pdserve.router.policy.verify_agrees``), the choices it
excludes, and the plan that falls back to a local prefill where no pair agrees."""

import dataclasses

import pytest

from pdserve.router.local_prefill import Decision, Reason
from pdserve.router.policy import WorkerSnapshot, disagreeing, pick_decode, pick_prefill, verify_agrees
from pdserve.router.request_run import _verify_agreed


def w(wid, role, verify, healthy=True):
    return WorkerSnapshot(wid, role, healthy, blocks_total=100, verify_kv=verify)


def test_only_a_pair_that_agrees_is_made_and_an_unknown_setting_agrees_with_both():
    assert verify_agrees(True, True) and verify_agrees(False, False)
    assert not verify_agrees(True, False) and not verify_agrees(False, True)
    assert verify_agrees(None, True) and verify_agrees(False, None)  # not polled yet


def test_the_prefill_and_decode_choices_pass_over_the_workers_that_disagree():
    workers = [w("p-on", "prefill", True), w("p-off", "prefill", False), w("d-on", "decode", True),
               w("m-off", "mixed", False), w("p-new", "prefill", None)]
    assert disagreeing(workers, True, "prefill") == {"p-off"}
    assert disagreeing(workers, False, "prefill") == {"p-on"}
    assert disagreeing(workers, True, "decode") == {"m-off"}  # a mixed worker reads as a decode worker
    assert disagreeing(workers, None, "decode") == frozenset()
    # p-off is the least loaded, but a reader that verifies never reads it
    workers[1] = dataclasses.replace(workers[1], queued_tokens=0)
    workers[0] = dataclasses.replace(workers[0], queued_tokens=500)
    assert pick_prefill(workers[:2]).worker_id == "p-off"
    assert pick_prefill(workers[:2], exclude=disagreeing(workers, True, "prefill")).worker_id == "p-on"
    assert pick_decode(workers, 1, exclude=disagreeing(workers, False, "decode")).worker_id == "m-off"


REMOTE = Decision(False, Reason.OFF, uncached_tokens=100, load=0.0)
PULL = Decision(False, Reason.PREFIX_ON_DECODE, uncached_tokens=10, load=0.0, decode_worker="d", prefix_from="d")


@pytest.mark.parametrize("decision", [REMOTE, PULL], ids=["remote", "reversed pull"])
def test_a_remote_plan_becomes_local_where_no_prefill_worker_agrees_with_its_decode_worker(decision):
    half = [w("p-off", "prefill", False), w("p-on", "prefill", True, healthy=False), w("d", "decode", True)]
    local = _verify_agreed(decision, half, True, False, "r")
    assert local.local and local.reason is Reason.VERIFY_MISMATCH and local.prefix_from is None
    assert local.decode_worker == decision.decode_worker  # the plan's decode worker prefills it
    assert _verify_agreed(decision, half, False, False, "r") == decision  # p-off agrees with a reader that does not verify
    assert _verify_agreed(decision, half, None, False, "r") == decision  # nothing known: as before


def test_after_a_refusal_the_next_attempt_is_local_whatever_the_stats_say():
    """The reader refused KV without checksums: the router's view of the holder was stale."""
    agree = [w("p", "prefill", True), w("d", "decode", True)]
    assert _verify_agreed(REMOTE, agree, True, False, "r") == REMOTE
    assert _verify_agreed(REMOTE, agree, True, True, "r").reason is Reason.VERIFY_MISMATCH
    already = Decision(True, Reason.SHORT_PROMPT, 5, 0.0)
    assert _verify_agreed(already, agree, True, True, "r") == already


def test_a_worker_advertises_its_setting_in_its_stats_and_is_unknown_until_polled():
    from pdserve.protos import worker_pb2
    from pdserve.router.pool import WorkerClient

    client = WorkerClient("prefill", "p", channel=None, stub=None, healthy=True)
    assert client.snapshot().verify_kv is None
    for verify in (True, False):
        client.stats = worker_pb2.WorkerStats(verify_kv=verify)
        assert client.snapshot().verify_kv is verify
