"""The faults under a steady load that tests/faults/test_under_load.py (two ranks per worker)
causes, and what it checks: every request
completes with exactly the tokens of an undisturbed run, or ends with a clear error before its
deadline; afterwards no surviving worker holds a block, and every dead or hung worker was
replaced. The cluster runs the tcp KV backend with leases far longer than any wait here. The
prefill worker's kill needs a read from it in flight: every read is posted ``READ_DELAY_S``
after its claim (at two ranks, whose other rank's agent is in another process, the cluster's
``inject_transfer_delay_s`` delays every read of its life; ``tests.helpers.faults.reads_delayed``
would reach rank 0's agent only)."""

import os
import signal
import time

import grpc
import ray

from tests.faults.load import Load
from tests.helpers.chat import chat_request, collect
from tests.helpers.faults import assert_no_kv_held, busy_worker, fresh_claim, gone, greedy_at_once
from tests.serving.conftest import worker_stats

READ_DELAY_S = 1.0  # every KV read is posted this long after its claim (kv_transfer inject_delay_s)
LEASE_S = 120.0  # far beyond every wait below: a freed block was freed on purpose
HANG_S = 5.0
REQUEST_TIMEOUT_S = 60.0
CLIENTS = 3
MAX_TOKENS = 16
PROMPTS = [f"Tell me a short fact about the number {i}." for i in range(6)]
REPLACED_WITHIN_S = 120.0


def pid_of(actor) -> int:
    return ray.get(actor.pid.remote(), timeout=10)


def wait_replaced(cluster, role: str, address: str, size: int = 2) -> None:
    deadline = time.monotonic() + REPLACED_WITHIN_S
    while address in cluster.addresses(role) or len(cluster.addresses(role)) < size:
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


def undisturbed(stub) -> dict[int, list[int]]:
    """Each of ``PROMPTS``' greedy tokens on the cluster before any fault (asked at once:
    ``tests.helpers.faults.greedy_at_once``)."""
    reference = dict(enumerate(greedy_at_once(stub, PROMPTS, MAX_TOKENS)))
    assert all(len(ids) == MAX_TOKENS for ids in reference.values())
    return reference


def assert_each_completed_or_failed_clearly(outcomes, reference: dict[int, list[int]], timeout_s: float) -> dict:
    """Every outcome has its undisturbed tokens, or a clear error (UNAVAILABLE or
    DEADLINE_EXCEEDED) that came no later than its deadline (plus 2 s of the client's own
    slack) after a start of them; returns a summary for further messages."""
    summary = {"completed": sum(o.code is None for o in outcomes),
               "errors": [(i, o.code.name, o.details) for i, o in enumerate(outcomes) if o.code is not None]}
    for o in outcomes:
        if o.code is None:
            assert o.tokens == reference[o.prompt], f"prompt {o.prompt}: tokens differ from the undisturbed run"
        else:
            assert o.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), summary
            assert o.ended - o.started <= timeout_s + 2, summary
            # Cut short, never wrong: what it was sent is the start of the undisturbed answer.
            assert o.tokens == reference[o.prompt][:len(o.tokens)], f"prompt {o.prompt}: a failed stream's tokens differ"
    return summary


def lose_nothing_under_faults(cluster, stub) -> None:
    """A decode worker SIGKILLed and one SIGSTOPped while they stream, a prefill worker killed
    with a read from it in flight (the cluster delays every read: ``inject_transfer_delay_s``),
    and the router SIGKILLed, all under a steady load: worker faults cost no request (they
    migrate); only the router's death ends requests, each with a clear error."""
    reference = undisturbed(stub)
    replaced_before = cluster._supervisor.replaced
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
        # on the same port, and the clients, reconnecting, are served again.
        before_router_kill = len(load.outcomes)
        kill_the_router_and_see_clients_served_again(cluster, load)

    outcomes = load.outcomes
    summary = assert_each_completed_or_failed_clearly(outcomes, reference, REQUEST_TIMEOUT_S)
    assert all(o.code is None for o in outcomes[:before_router_kill]), summary
    assert cluster._supervisor.replaced - replaced_before == 3
    assert cluster._supervisor.hung_killed >= 1
    failures_after = sum(worker_stats(a, "decode").kv_transfer_failures for a in cluster.addresses("decode"))
    assert failures_after > failures_mid  # the read failed, and it was counted

    assert_no_kv_held(cluster)  # well within the lease: nothing passes by expiry
    ids, _, _ = collect(stub.Generate(chat_request(PROMPTS[0], MAX_TOKENS, ignore_eos=True), timeout=120))
    assert ids == reference[0]
    print(f"under load: {len(outcomes)} requests, {summary['completed']} complete with their tokens, "
          f"{len(summary['errors'])} ended with a clear error, longest "
          f"{max(o.ended - o.started for o in outcomes):.1f} s")


def sigterm_drains_then_replaced(cluster, stub) -> None:
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
