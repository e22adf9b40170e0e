"""A rollout that turns KV verification on or off (``pdserve rollout --verify-kv``,
``pdserve.cluster.rollout.roll_verify``): pool by pool, holders first when it turns on, readers
first when it turns off; each pool's new workers start with the new setting, and the other
pool's keep the old one until its turn. Over a cluster double that records what it is asked
(the surge and drain of each worker are ``roll``'s, tested on a real cluster in
tests/faults/test_rollout.py)."""

import threading

import pytest

from pdserve import cli
from pdserve.cluster import rollout
from pdserve.elastic_worker.worker import ElasticWorkerConfig
from tests.factories import decode_worker_config, prefill_worker_config


class Cluster:
    """What ``roll_verify`` and ``roll`` use of a ``LocalCluster``; ``events`` in order."""

    def __init__(self, verify: bool):
        self.lock = threading.Lock()
        self.templates = {"prefill": prefill_worker_config(verify_kv=verify),
                          "decode": decode_worker_config(verify_kv=verify)}
        self.workers = {"prefill": ["p0", "p1"], "decode": ["d0", "d1"]}
        self.events: list[tuple] = []

    def change_template(self, role, change):
        self.templates[role] = change(self.templates[role])

    def addresses(self, role):
        return self.workers[role]

    def scale_up(self, role):
        new = f"{role}-new{len(self.events)}"
        self.workers[role].append(new)
        # the setting the new worker starts with, and the other pool's template meanwhile
        other = "decode" if role == "prefill" else "prefill"
        self.events.append(("start", role, self.templates[role].verify_kv, self.templates[other].verify_kv))
        return new

    def retire(self, role, address, grace_s):
        self.workers[role].remove(address)
        self.events.append(("stop", role, address))
        return True


@pytest.fixture(autouse=True)
def listed_at_once(monkeypatch):
    monkeypatch.setattr(rollout, "_wait_listed", lambda *args: None)  # no router to ask


@pytest.mark.parametrize("verify, first, then", [(True, "prefill", "decode"), (False, "decode", "prefill")],
                         ids=["on: holders first", "off: readers first"])
def test_verification_changes_pool_by_pool_in_its_order(verify, first, then):
    cluster = Cluster(verify=not verify)
    done = rollout.roll_verify(cluster, verify)
    assert [r.pool for r in done] == [first, first, then, then]
    assert [(e[0], e[1]) for e in cluster.events] == [("start", first), ("stop", first)] * 2 + \
        [("start", then), ("stop", then)] * 2  # every old one of the first pool stops before the next starts
    starts = [e for e in cluster.events if e[0] == "start"]
    assert all(e[2] is verify for e in starts)  # each new worker with the new setting
    assert [e[3] for e in starts] == [not verify, not verify, verify, verify]  # the second pool changes only on its turn
    assert cluster.workers[first] == [w for w in cluster.workers[first] if "new" in w]  # none of the old left


def test_an_elastic_workers_config_changes_in_both_its_roles():
    both = ElasticWorkerConfig(prefill=prefill_worker_config(worker_id="e-0", verify_kv=False),
                               decode=decode_worker_config(worker_id="e-0", verify_kv=False))
    on = rollout.with_verify(both, True)
    assert on.prefill.verify_kv and on.decode.verify_kv and on.role == both.role


@pytest.mark.parametrize("argv", [["rollout", "--address", "x"], ["rollout", "--address", "x", "--pool", "decode",
                                                                  "--verify-kv", "on"]],
                         ids=["neither", "both"])
def test_the_cli_takes_a_pool_or_a_setting_to_roll(argv, capsys):
    assert cli.main(argv) == 2
    assert "give --pool or --verify-kv" in capsys.readouterr().err
