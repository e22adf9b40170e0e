"""Elastic workers changing role in place under a steady load (``pdserve.elastic_worker``,
``pdserve.cluster.roles``): one worker moves prefill -> decode -> prefill -> decode -> prefill
while clients keep greedy streams running, then a busy decode worker switches with no grace
and hands its streams over with their KV. Every stream completes with exactly the tokens of an undisturbed
run, none fails, the process (and so the loaded model) stays the same, the router counts each
switch and its time, and afterwards no worker holds a KV block.

The cluster runs the real default model in float32, so outputs compare token for token.
"""

import time
import urllib.request

import pytest
import ray

from tests.clusters import cluster_config, reconnecting_stub, running_cluster
from tests.faults.load import Load
from tests.helpers.faults import assert_no_kv_held, busy, check, greedy_at_once, migrations

pytestmark = pytest.mark.slow

LEASE_S = 120.0  # far beyond every wait here: a freed block was freed on purpose, not by expiry
REQUEST_TIMEOUT_S = 60.0
CLIENTS = 3
MAX_TOKENS = 16
LONG_TOKENS = 32  # streams still running when a worker with no grace switches
PROMPTS = [f"Tell me a short fact about the number {i}." for i in range(3)]
GRACE_S = 60.0  # far beyond a 16-token stream: a graceful switch migrates nothing


@pytest.fixture(scope="module")
def cluster():
    with running_cluster(cluster_config(dtype="float32", num_prefill=2, num_decode=1, elastic_roles=True,
                                        lease_seconds=LEASE_S, router_poll_s=0.2)) as c:
        yield c


@pytest.fixture(scope="module")
def stub(cluster):
    with reconnecting_stub(cluster.address) as stub:
        yield stub


@pytest.fixture(scope="module")
def reference(stub):
    """Each prompt's greedy tokens from the cluster before any switch (greedy with ignore_eos:
    the shorter run is the longer one's beginning)."""
    out = {}
    for i, ids in enumerate(greedy_at_once(stub, PROMPTS, LONG_TOKENS)):
        assert len(ids) == LONG_TOKENS
        out[(i, LONG_TOKENS)], out[(i, MAX_TOKENS)] = ids, ids[:MAX_TOKENS]
    return out


def switch_metrics(cluster) -> dict[str, float]:
    """The router's role-switch series: each sample's name with its labels -> value."""
    with urllib.request.urlopen(f"http://{cluster.http_address}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return {name: float(value) for name, value in (line.rsplit(" ", 1) for line in lines)
            if name.startswith(("pdserve:role_changes_total", "pdserve:role_switch_seconds_count"))}


def changes(metrics: dict[str, float], from_role: str, to_role: str, reason: str) -> float:
    return metrics.get(f'pdserve:role_changes_total{{from_role="{from_role}",reason="{reason}",to_role="{to_role}"}}',
                       0.0)


def run_balancer(cluster, stub, balancer, after_switch_s: float = 0.0) -> Load:
    """``balancer`` running on ``cluster`` under the clients' load until it made a switch (or 60 s
    passed), ``after_switch_s`` more, then stopped; the load's outcomes after it drained."""
    cluster.role_balancer = balancer  # as LocalCluster._start_loops sets it: its pressures go with each push
    try:
        with Load(stub, PROMPTS, MAX_TOKENS, CLIENTS, REQUEST_TIMEOUT_S) as load:
            load.wait_for(CLIENTS)
            balancer.start()
            deadline = time.monotonic() + 60
            while not balancer.switches and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(after_switch_s)
            balancer.stop()
            load.wait_for(CLIENTS)
    finally:
        balancer.stop()
        cluster.role_balancer = None
    return load


def test_a_worker_switches_role_back_and_forth_under_load_losing_nothing(cluster, stub, reference):
    worker = cluster.prefill_addresses[1]
    pid = ray.get(cluster.prefill[1].pid.remote(), timeout=10)
    migrated = migrations(cluster)
    switches = []
    with Load(stub, PROMPTS, MAX_TOKENS, CLIENTS, REQUEST_TIMEOUT_S) as load:
        load.wait_for(CLIENTS)
        for role in ("decode", "prefill", "decode", "prefill"):
            switches.append((time.monotonic(), cluster.set_role(worker, role, GRACE_S, reason="test")))
            assert worker in cluster.addresses(role) and cluster.role_of(worker) == role
            load.wait_for(CLIENTS)  # served with the worker in its new role
    check(load.outcomes, reference, MAX_TOKENS)
    for started, done in switches:
        assert done.idle and done.handed_over == 0, done
        assert done.seconds >= done.worker_seconds >= 0
    assert any(load.spanning(t) for t, _ in switches), "no request was running during any switch"
    assert migrations(cluster) == migrated, "a graceful switch migrated streams"
    assert ray.get(cluster.prefill[-1].pid.remote(), timeout=10) == pid  # the same process: no reload
    metrics = switch_metrics(cluster)
    assert changes(metrics, "prefill", "decode", "test") == 2 and changes(metrics, "decode", "prefill", "test") == 2
    assert metrics['pdserve:role_switch_seconds_count{to_role="decode"}'] == 2
    assert metrics['pdserve:role_switch_seconds_count{to_role="prefill"}'] == 2
    assert_no_kv_held(cluster)


def kv_moves(cluster) -> tuple[float, float]:
    """The router's streams moved with their KV: as it continued them, and as switches reported them."""
    with urllib.request.urlopen(f"http://{cluster.http_address}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    total = {name: sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + "{"))
             for name in ("pdserve:request_kv_moves_total", "pdserve:role_switch_streams_kv_moved_total")}
    return total["pdserve:request_kv_moves_total"], total["pdserve:role_switch_streams_kv_moved_total"]


def test_a_decode_worker_out_of_grace_moves_its_streams_with_their_kv(cluster, stub, reference):
    """Grace 0: the decode worker switches with streams running. Each decoding stream's KV stays
    held there under a lease; the router continues it on the other decode worker, which reads
    that KV over NIXL and decodes on: no re-prefill. Every stream completes with its undisturbed
    tokens, the router counts the moves, and no lease is left (each was read)."""
    spare = cluster.prefill_addresses[-1]
    cluster.set_role(spare, "decode", GRACE_S, reason="test")  # so the decode pool keeps a worker
    migrated, (moved, reported) = migrations(cluster), kv_moves(cluster)
    with Load(stub, PROMPTS, LONG_TOKENS, CLIENTS, REQUEST_TIMEOUT_S) as load:
        victim = busy([a for a in cluster.decode_addresses if a != spare])
        done = cluster.set_role(victim, "prefill", 0.0, reason="test")
        assert not done.idle and done.handed_over >= 1 and done.kv_moved >= 1, done
        load.wait_for(2 * CLIENTS)
        # Back to the layout the cluster began with, the decode pool never empty (a prompt
        # prefilled meanwhile would wait for a decode worker, and be re-prefilled)
        cluster.set_role(victim, "decode", GRACE_S, reason="test")
        cluster.set_role(spare, "prefill", GRACE_S, reason="test")
        load.wait_for(CLIENTS)
    check(load.outcomes, reference, LONG_TOKENS)
    # A stream handed over before its KV was whole (its prompt or its KV still on the way) is
    # re-prefilled; every other one moved. A stream that finished as the switch came counts as
    # handed over with nothing to move or re-prefill, hence at most.
    assert kv_moves(cluster) == (moved + done.kv_moved, reported + done.kv_moved)
    assert migrations(cluster) - migrated <= done.handed_over - done.kv_moved
    assert len(cluster.prefill_addresses) == 2 and len(cluster.decode_addresses) == 1
    assert_no_kv_held(cluster)


def test_the_budget_policy_moves_a_worker_to_the_pool_under_pressure(cluster, stub, reference):
    """The controller's budget loop (pdserve.cluster.role_balancer) on the real cluster: targets
    set so that running streams put the decode pool far over its target while the prefill pool
    stays far under, it moves one prefill worker to decode by itself, with the streams intact,
    and the router counts the switch under the policy's reason and shows both pressures."""
    from pdserve.cluster.autoscaling import pool_config
    from pdserve.cluster.autoscaling.budget import BudgetConfig
    from pdserve.cluster.role_balancer import RoleBalancer

    targets = {"prefill": pool_config("prefill", target=1e9, slo_s=1e6),  # never pressed
               "decode": pool_config("decode", target=0.001, slo_s=1e6)}  # any stream's KV: pressed
    balancer = RoleBalancer(cluster, BudgetConfig(window_s=2.0, dwell_s=2.0), targets, interval_s=0.25,
                            grace_s=GRACE_S)
    before = changes(switch_metrics(cluster), "prefill", "decode", "decode_pressure")
    load = run_balancer(cluster, stub, balancer)
    assert balancer.switches, [m.reason for _, m in list(balancer.moves)[-5:]]
    (moved,) = balancer.switches  # the dwell and the settling window held back a second one
    assert (moved.previous, moved.role, moved.reason) == ("prefill", "decode", "decode_pressure")
    assert moved.idle and moved.handed_over == 0, moved
    check(load.outcomes, reference, MAX_TOKENS)
    metrics = switch_metrics(cluster)
    assert changes(metrics, "prefill", "decode", "decode_pressure") == before + 1
    with urllib.request.urlopen(f"http://{cluster.http_address}/metrics", timeout=10) as r:
        text = r.read().decode()
    assert 'pdserve:role_budget_pressure{pool="decode"}' in text and 'pdserve:role_budget_pressure{pool="prefill"}' in text
    assert len(cluster.prefill_addresses) == 1 and len(cluster.decode_addresses) == 2
    actor = cluster.decode[cluster.decode_addresses.index(moved.address)]
    described = ray.get(actor.describe.remote(), timeout=10)  # what a controller adopting it would read
    assert described["role"] == "decode" and described["config"].role == "decode"
    cluster.set_role(moved.address, "prefill", GRACE_S, reason="test")  # the layout the module began with
    assert ray.get(actor.describe.remote(), timeout=10)["role"] == "prefill"
    assert_no_kv_held(cluster)


def prefill_decisions(cluster) -> dict[tuple[str, str], float]:
    """The router's ``pdserve:local_prefill_decisions_total`` by (decision, reason)."""
    with urllib.request.urlopen(f"http://{cluster.http_address}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    out: dict[tuple[str, str], float] = {}
    for line in lines:
        if line.startswith("pdserve:local_prefill_decisions_total{"):
            labels, value = line.rsplit(" ", 1)
            fields = dict(part.split("=", 1) for part in labels[labels.index("{") + 1:-1].split(","))
            key = (fields["decision"].strip('"'), fields["reason"].strip('"'))
            out[key] = out.get(key, 0.0) + float(value)
    return out


def test_workers_go_mixed_and_back_under_load_losing_nothing(cluster, stub, reference):
    """The mixed role: the decode worker becomes mixed and prefills its own requests (no drain:
    the same core stays open), then both prefill workers become mixed (their prefill cores
    drain), so the cluster runs colocated with no prefill pool; then back to two prefill
    workers and one decode worker. Every stream keeps its greedy tokens, nothing migrates, the
    router counts the local prefills under the mixed reasons, and no KV is held after."""
    (decode,) = cluster.decode_addresses
    prefill = list(cluster.prefill_addresses)
    migrated, before = migrations(cluster), prefill_decisions(cluster)
    steps = [(decode, "mixed"), (prefill[0], "mixed"), (prefill[1], "mixed"),
             (prefill[1], "prefill"), (prefill[0], "prefill"), (decode, "decode")]
    switches = []
    with Load(stub, PROMPTS, MAX_TOKENS, CLIENTS, REQUEST_TIMEOUT_S) as load:
        load.wait_for(CLIENTS)
        for address, role in steps:
            switches.append((time.monotonic(), cluster.set_role(address, role, GRACE_S, reason="test")))
            assert cluster.role_of(address) == role
            load.wait_for(CLIENTS)  # served in the new layout
            if role == "mixed" and address == prefill[1]:  # every worker mixed: colocated, no prefill pool
                assert cluster.prefill_addresses == [] and len(cluster.decode_addresses) == 3
    check(load.outcomes, reference, MAX_TOKENS)
    for started, done in switches:
        assert done.idle and done.handed_over == 0, done
    assert switches[0][1].worker_seconds < 1.0  # decode -> mixed drains nothing
    assert any(load.spanning(t) for t, _ in switches), "no request was running during any switch"
    assert migrations(cluster) == migrated, "a graceful switch migrated streams"
    after = prefill_decisions(cluster)
    assert after.get(("local", "mixed_worker"), 0) > before.get(("local", "mixed_worker"), 0)
    metrics = switch_metrics(cluster)
    assert changes(metrics, "decode", "mixed", "test") == 1 and changes(metrics, "prefill", "mixed", "test") == 2
    assert changes(metrics, "mixed", "decode", "test") == 1 and changes(metrics, "mixed", "prefill", "test") == 2
    assert sorted(cluster.prefill_addresses) == sorted(prefill) and cluster.decode_addresses == [decode]
    assert cluster.mixed == set()
    assert_no_kv_held(cluster)


def test_the_budget_policy_makes_the_only_decode_worker_mixed_when_prompts_wait(cluster, stub, reference):
    """The half move on the real cluster: targets set so that every first token misses the
    prefill SLO while the decode pool idles far under its own. The decode pool is at its
    minimum (one worker), so no whole move: the loop makes that worker mixed by itself, in
    place, and then holds (no plain decode worker is left to mix). Streams keep their tokens."""
    from pdserve.cluster.autoscaling import pool_config
    from pdserve.cluster.autoscaling.budget import BudgetConfig
    from pdserve.cluster.role_balancer import RoleBalancer

    targets = {"prefill": pool_config("prefill", target=1e9, slo_s=1e-6),  # every TTFT misses it
               "decode": pool_config("decode", target=1.0, slo_s=1e6)}  # a few streams' KV: far under
    balancer = RoleBalancer(cluster, BudgetConfig(window_s=2.0, dwell_s=2.0), targets, interval_s=0.25,
                            grace_s=GRACE_S)
    (decode,) = cluster.decode_addresses
    before = changes(switch_metrics(cluster), "decode", "mixed", "prefill_pressure")
    load = run_balancer(cluster, stub, balancer, after_switch_s=3.0)  # past the dwell: it holds, nothing left to mix
    assert balancer.switches, [m.reason for _, m in list(balancer.moves)[-5:]]
    (moved,) = balancer.switches
    assert (moved.address, moved.previous, moved.role, moved.reason) == (decode, "decode", "mixed", "prefill_pressure")
    assert moved.idle and moved.worker_seconds < 1.0, moved
    after = [m for t, m in balancer.moves if t > balancer.last_switch_t]
    assert after and all(m.taker is None for m in after), [m.reason for m in after]  # held, nothing left to mix
    check(load.outcomes, reference, MAX_TOKENS)
    assert changes(switch_metrics(cluster), "decode", "mixed", "prefill_pressure") == before + 1
    assert cluster.role_of(decode) == "mixed" and len(cluster.prefill_addresses) == 2
    cluster.set_role(decode, "decode", GRACE_S, reason="test")  # the layout the module began with
    assert_no_kv_held(cluster)


def test_a_busy_elastic_decode_worker_scaled_down_moves_its_streams_with_their_kv(cluster, stub, reference):
    """Retiring (scale-down, ``pdserve rollout``) an elastic decode worker with streams running:
    the controller takes it out of the routing table, its streams get no time to finish here
    (``hand_over_after_s=0``), and they move with their KV to the other decode worker, which
    reads it over NIXL; the drain waits for those reads, then the worker stops. Every stream
    keeps its undisturbed tokens, and no KV is left held. The module's last test: the cluster ends one decode worker smaller."""
    spare = cluster.prefill_addresses[-1]
    cluster.set_role(spare, "decode", GRACE_S, reason="test")  # the decode pool keeps a worker
    moved, _ = kv_moves(cluster)
    with Load(stub, PROMPTS, LONG_TOKENS, CLIENTS, REQUEST_TIMEOUT_S) as load:
        victim = busy([a for a in cluster.decode_addresses if a != spare])
        # The leases outlast the drain's timeout (LEASE_S): idle means each moved KV was read
        idle = cluster.retire("decode", victim, drain_timeout_s=60.0, hand_over_after_s=0.0)
        load.wait_for(CLIENTS)
    check(load.outcomes, reference, LONG_TOKENS)
    assert idle, "the retired worker still held KV or streams at the drain's end"
    assert cluster.decode_addresses == [spare] and victim not in cluster.prefill_addresses
    assert kv_moves(cluster)[0] > moved, "no stream running on it moved with its KV"
    assert_no_kv_held(cluster)
