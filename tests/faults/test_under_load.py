"""Faults under a steady load: while clients keep requests running, a decode worker is
SIGKILLed mid-stream, a decode worker is SIGSTOPped (a hang, not a death), a prefill
worker is SIGKILLed while a KV read from it is in flight, and the router is SIGKILLed. Every request either completes
with exactly the tokens of an undisturbed run, or ends with a clear error before its
deadline; only the router's death may end requests. Then, well within the lease, no
surviving worker holds a block, and every dead or hung process was replaced.

The cluster runs the real default model in float32 (outputs compare token for token) over
the tcp KV backend: a read is a connection to the holder's block server, so a holder that is
stopped keeps a posted read open, and killing it then fails the read mid-flight. Leases last
far longer than the checks wait, so nothing here passes by lease expiry.
"""

import os
import signal
import time

import grpc
import pytest
import ray

from tests.clusters import cluster_config, reconnecting_stub, running_cluster
from tests.faults.load import Load
from tests.helpers.chat import chat_request, collect
from tests.helpers.faults import busy_worker, fresh_claim, gone
from tests.serving.conftest import worker_stats

pytestmark = pytest.mark.slow

READ_DELAY_S = 1.0  # every KV read is posted this long after its claim (kv_transfer inject_delay_s)
LEASE_S = 120.0  # far beyond every wait below: a freed block was freed on purpose
HANG_S = 5.0
REQUEST_TIMEOUT_S = 60.0
CLIENTS = 3
MAX_TOKENS = 16
PROMPTS = [f"Tell me a short fact about the number {i}." for i in range(6)]
CLEAN_WITHIN_S = 20.0  # every surviving worker holds no block within this (< LEASE_S)
REPLACED_WITHIN_S = 120.0


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def cluster(request):
    """The default model; or, at two tensor-parallel ranks per worker, the tiny model with the
    default tokenizer (``tests.serving.test_tensor_parallel``): a process killed or stopped is
    then a worker's rank 0, and its other rank leaves with it. (The router, which runs no ranks,
    is killed on the tp1 cluster only; tests/serving/test_faults.py's router paths run at tp1,
    their rank side is proved here.)"""
    tp = {}
    if request.param > 1:
        from pdserve.engine.config import CacheConfig, EngineConfig

        model = str(request.getfixturevalue("tool_llama")[0])
        tp = dict(engine=EngineConfig(model=model, dtype="float32", cache=CacheConfig(memory_budget_bytes=96 << 20)),
                  prefill_tp=request.param, decode_tp=request.param)
    with running_cluster(cluster_config(
            dtype="float32", num_prefill=2, num_decode=2, http_port=None, lease_seconds=LEASE_S,
            kv_transfer_backend="tcp", inject_transfer_delay_s=READ_DELAY_S, router_poll_s=0.2,
            supervise_interval_s=0.5, hang_timeout_s=HANG_S, **tp)) as c:
        yield c


@pytest.fixture(scope="module")
def stub(cluster):
    with reconnecting_stub(cluster.address) as stub:  # back within a second once the router is back
        yield stub


def pid_of(actor) -> int:
    return ray.get(actor.pid.remote(), timeout=10)


def wait_replaced(cluster, role: str, address: str) -> None:
    deadline = time.monotonic() + REPLACED_WITHIN_S
    while address in cluster.addresses(role) or len(cluster.addresses(role)) < 2:
        assert time.monotonic() < deadline, f"{role} worker {address} was not replaced"
        time.sleep(0.2)


def kill_the_router_and_see_clients_served_again(cluster, load: Load) -> None:
    restarted = cluster._supervisor.routers_restarted
    os.kill(pid_of(cluster.router), signal.SIGKILL)
    deadline = time.monotonic() + REPLACED_WITHIN_S
    while cluster._supervisor.routers_restarted == restarted:
        assert time.monotonic() < deadline, "the router was not restarted"
        time.sleep(0.2)
    served = sum(o.code is None for o in load.outcomes)
    deadline = time.monotonic() + 60
    while sum(o.code is None for o in load.outcomes) < served + CLIENTS:
        assert time.monotonic() < deadline, "clients were not served by the restarted router"
        time.sleep(0.2)


def test_nothing_is_lost_under_faults_and_steady_load(cluster, stub):
    reference = {i: collect(stub.Generate(chat_request(p, MAX_TOKENS, ignore_eos=True), timeout=120))[0]
                 for i, p in enumerate(PROMPTS)}
    assert all(len(ids) == MAX_TOKENS for ids in reference.values())
    replaced_before = cluster._supervisor.replaced
    stopped_pid = None
    with Load(stub, PROMPTS, MAX_TOKENS, CLIENTS, REQUEST_TIMEOUT_S, pause_after_error_s=0.2) as load:
        load.wait_for(CLIENTS)

        # (b) a decode worker SIGKILLed while it streams
        index = busy_worker(cluster, "decode", "num_running")
        address = cluster.decode_addresses[index]
        os.kill(pid_of(cluster.decode[index]), signal.SIGKILL)
        wait_replaced(cluster, "decode", address)
        load.wait_for(CLIENTS)

        # (c) a decode worker SIGSTOPped while it streams: alive to the OS, hung to the cluster
        index = busy_worker(cluster, "decode", "num_running")
        address, stopped_pid = cluster.decode_addresses[index], pid_of(cluster.decode[index])
        os.kill(stopped_pid, signal.SIGSTOP)
        wait_replaced(cluster, "decode", address)
        assert gone(stopped_pid), "the hung worker was replaced but its process lives on"
        load.wait_for(CLIENTS)

        # (a) a prefill worker SIGKILLed while a read from it is in flight: it is stopped within
        # READ_DELAY_S of granting a claim, so the claim's read, posted READ_DELAY_S after it,
        # goes to a stopped holder and stays open; then it is killed, and the read fails.
        # Seeing a worker merely hold a claim is not enough: on a loaded machine one poll once
        # took longer than READ_DELAY_S, the read was over, and nothing failed (fresh_claim).
        # The pids are asked for first, for the same reason.
        failures_mid = sum(worker_stats(a, "decode").kv_transfer_failures for a in cluster.decode_addresses)
        pids = {a: pid_of(actor) for a, actor in zip(list(cluster.prefill_addresses), list(cluster.prefill))}
        index = fresh_claim(cluster, READ_DELAY_S * 0.8)
        address = cluster.prefill_addresses[index]
        pid = pids[address]
        os.kill(pid, signal.SIGSTOP)
        time.sleep(READ_DELAY_S + 0.5)
        os.kill(pid, signal.SIGKILL)
        wait_replaced(cluster, "prefill", address)
        load.wait_for(CLIENTS)

        # (d) the router SIGKILLed: its streams end UNAVAILABLE, the supervisor starts a new one
        # on the same port, and the clients, reconnecting, are served again. The router runs
        # no ranks: once, on the tp1 cluster.
        before_router_kill = None  # at tp2 every request must complete
        if cluster.config.decode_tp == 1:
            before_router_kill = len(load.outcomes)
            kill_the_router_and_see_clients_served_again(cluster, load)

    outcomes = load.outcomes
    summary = {"completed": sum(o.code is None for o in outcomes),
               "errors": [(i, o.code.name, o.details) for i, o in enumerate(outcomes) if o.code is not None]}
    for o in outcomes:
        if o.code is None:
            assert o.tokens == reference[o.prompt], f"prompt {o.prompt}: tokens differ from the undisturbed run"
        else:  # a clear error, before the deadline
            assert o.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), summary
            assert o.ended - o.started <= REQUEST_TIMEOUT_S + 2, summary
    # Worker faults cost no request (they migrate); only the router's death ends requests.
    assert all(o.code is None for o in outcomes[:before_router_kill]), summary
    assert cluster._supervisor.replaced - replaced_before == 3
    assert cluster._supervisor.hung_killed >= 1
    live = [(role, a) for role in ("prefill", "decode") for a in cluster.addresses(role)]
    failures_after = sum(worker_stats(a, "decode").kv_transfer_failures for role, a in live if role == "decode")
    assert failures_after > failures_mid  # the read failed, and it was counted

    deadline = time.monotonic() + CLEAN_WITHIN_S
    while True:
        busy = {a: (s.num_blocks_used, s.num_held_leases) for role, a in live
                if (s := worker_stats(a, role)).num_blocks_used or s.num_held_leases}
        if not busy:
            break
        assert time.monotonic() < deadline, f"blocks still held {CLEAN_WITHIN_S} s after the load: {busy}"
        time.sleep(0.2)
    ids, _, _ = collect(stub.Generate(chat_request(PROMPTS[0], MAX_TOKENS, ignore_eos=True), timeout=120))
    assert ids == reference[0]


def test_sigterm_drains_a_ray_worker_actor_then_it_is_replaced(cluster, stub):
    """SIGTERM to a worker actor's process (what Kubernetes sends) drains it as it drains a
    plain worker process: it reports draining while it finishes its stream, then exits."""
    request = chat_request(PROMPTS[1], 48, ignore_eos=True)
    reference, _, _ = collect(stub.Generate(request, timeout=120))
    stream = stub.Generate(request, timeout=120)
    got = list(next(stream).token_ids)
    index = busy_worker(cluster, "decode", "num_running")
    address, pid = cluster.decode_addresses[index], pid_of(cluster.decode[index])
    os.kill(pid, signal.SIGTERM)
    stats = worker_stats(address, "decode")
    deadline = time.monotonic() + 10
    while not stats.draining:
        assert time.monotonic() < deadline, "the worker did not start draining"
        stats = worker_stats(address, "decode")
    assert stats.num_running >= 1  # it drains: the stream is still being served there
    got += collect(stream)[0]
    assert got == reference
    deadline = time.monotonic() + 30
    while not gone(pid):
        assert time.monotonic() < deadline, "the drained worker did not exit"
        time.sleep(0.1)
    wait_replaced(cluster, "decode", address)
