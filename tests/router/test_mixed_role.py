"""The router's side of the mixed role (an elastic worker in the decode pool that also prefills
the requests it takes, pdserve/router/local_prefill.py): pure rules over worker snapshots, and the
pool's readiness and per-pool load with a mixed worker in it."""

import pytest

from pdserve.protos import worker_pb2
from pdserve.router.local_prefill import LocalPrefillConfig, Mixed, Reason, decide
from pdserve.router.policy import WorkerSnapshot, pick_decode, pick_prefill
from pdserve.router.pool import WorkerClient, WorkerPool, pool_loads
from pdserve.router.request_run import _mixed


def w(wid, role, queued=0, used=0, total=100, healthy=True, draining=False):
    return WorkerSnapshot(wid, role, healthy, draining, queued_tokens=queued, blocks_used=used, blocks_total=total)


OFF, CONDITIONAL = LocalPrefillConfig(), LocalPrefillConfig(max_tokens=64, max_load=0.5)


@pytest.mark.parametrize("cfg", [OFF, CONDITIONAL], ids=["conditional off", "conditional on"])
def test_a_mixed_worker_prefills_its_own_request_unless_a_prefill_worker_queues_less(cfg):
    """Whatever the conditional rule says for plain decode workers (a long prompt here)."""
    def on_mixed(own, prefill):
        return decide(cfg, 1000, 0.9, mixed=Mixed(worker=True, own_queue=own, prefill_queue=prefill, any_mixed=True))

    assert on_mixed(0, 0).reason is Reason.MIXED_WORKER  # a tie stays local: no KV to move
    assert on_mixed(500, 499).reason is Reason.PREFILL_SHORTER and not on_mixed(500, 499).local
    assert on_mixed(499, 500).local
    assert on_mixed(10_000, None).reason is Reason.MIXED_WORKER  # no prefill worker: however long its queue


def test_plain_decode_workers_prefill_locally_once_every_prefill_worker_is_mixed():
    alone = Mixed(worker=False, prefill_queue=None, any_mixed=True)
    assert decide(OFF, 1000, 0.9, mixed=alone).reason is Reason.NO_PREFILL_WORKER
    # with a prefill worker left, or no mixed worker at all (a crashed prefill pool waits for
    # its replacement), the usual rule decides
    assert decide(OFF, 1000, 0.0, mixed=Mixed(prefill_queue=0, any_mixed=True)).reason is Reason.OFF
    assert decide(OFF, 1000, 0.0, mixed=Mixed(prefill_queue=None, any_mixed=False)).reason is Reason.OFF
    assert decide(CONDITIONAL, 10, 0.0, mixed=Mixed(prefill_queue=0, any_mixed=True)).reason is Reason.SHORT_PROMPT


def test_colocated_mode_is_not_changed_by_mixed_workers():
    assert decide(LocalPrefillConfig(colocated=True), 10, 0.0,
                  mixed=Mixed(worker=True, own_queue=9, prefill_queue=0)).reason is Reason.COLOCATED


def test_a_mixed_worker_takes_streams_and_never_a_prompt_for_another():
    workers = [w("p", "prefill", queued=900), w("m", "mixed", queued=0, used=10), w("d", "decode", used=50)]
    assert pick_decode(workers, 1).worker_id == "m"  # least KV in use, mixed or not
    assert pick_decode(workers, 1, exclude=frozenset({"m"})).worker_id == "d"
    assert pick_prefill(workers).worker_id == "p"  # its shorter queue does not make it a prefill worker
    only_mixed = [w("m", "mixed")]
    assert pick_prefill(only_mixed).pool_empty
    assert pick_decode(only_mixed, 1).worker_id == "m"
    assert pick_decode([w("m", "mixed", draining=True)], 1).pool_empty


def test_the_rules_inputs_come_from_the_routable_workers():
    snapshots = [w("p1", "prefill", queued=300), w("p2", "prefill", queued=100), w("p3", "prefill", queued=0, healthy=False),
                 w("m", "mixed", queued=200), w("d", "decode")]
    assert _mixed(snapshots, snapshots[3], None) == Mixed(worker=True, own_queue=200, prefill_queue=100, any_mixed=True)
    assert _mixed(snapshots, snapshots[4], None) == Mixed(worker=False, own_queue=0, prefill_queue=100, any_mixed=True)
    # No routable prefill worker (hung, dead, being replaced): the decode worker prefills.
    assert _mixed([w("d", "decode")], None, None) == Mixed(prefill_queue=None, any_mixed=False, prefill_down=True)
    assert _mixed(snapshots[2:3] + snapshots[4:], None, None).prefill_down


def _client(role, address, **stats):
    client = WorkerClient(role, address, channel=None, stub=None)
    client.stats, client.healthy = worker_pb2.WorkerStats(**stats), True
    return client


def test_a_mixed_worker_makes_the_pool_ready_and_counts_in_the_decode_pool():
    pool = WorkerPool()
    pool.workers["m"] = _client("mixed", "m", num_running=3, num_blocks_used=5, num_blocks_total=10)
    assert pool.ready() and pool.missing_roles() == []  # it prefills and decodes
    pool.workers["d"] = _client("decode", "d", num_running=1, num_blocks_used=1, num_blocks_total=10)
    loads = pool_loads(pool.workers.values())
    assert loads["decode"].replicas == 2 and loads["decode"].running == 4 and loads["decode"].kv_usage == 0.3
    assert loads["prefill"].replicas == 0
    del pool.workers["m"]
    assert pool.missing_roles() == ["prefill"]
