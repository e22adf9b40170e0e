"""Stalls: a worker that is alive and reachable but never finishes its part. A KV holder that
accepts a read and never sends, a reader that never receives, a prefill worker that accepts a
call and never answers, and a prefill worker frozen (SIGSTOP) while it holds KV and calls.
Each is caused in one worker under a steady load (``ServerActor.inject_fault``, or a signal),
and then undone or replaced. Every request completes with its undisturbed tokens, or ends with
a clear error before its deadline; afterwards no worker holds a block or a lease."""

import os
import signal
import time

import pytest
import ray

from tests.conformance.conftest import TRANSFER_TIMEOUT_S
from tests.faults.load import Load
from tests.helpers.chat import chat_request, collect
from tests.helpers.faults import assert_no_kv_held, fresh_claim, gone, reads_delayed
from tests.helpers.under_load import (CLIENTS, MAX_TOKENS, PROMPTS, READ_DELAY_S, assert_each_completed_or_failed_clearly,
                                      pid_of, wait_replaced)
from tests.serving.conftest import worker_stats

pytestmark = pytest.mark.slow

TIMEOUT_S = 30.0  # each request's deadline (the client's gRPC timeout)


def transfer_failures(cluster) -> int:
    return sum(worker_stats(a, "decode").kv_transfer_failures for a in cluster.decode_addresses)


def until(condition, what: str, cluster, timeout_s: float = 60.0) -> float:
    """Seconds until ``condition()`` held."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout_s:
            seen = {a: (s.kv_transfers, s.kv_transfer_failures) for a in cluster.decode_addresses
                    if (s := worker_stats(a, "decode"))}
            raise AssertionError(f"{what} did not happen within {timeout_s} s; decode (reads, failed): {seen}")
        time.sleep(0.1)
    return time.monotonic() - start


def serving_prefill(cluster, stub):
    """The prefill worker the load's prompts go to now (their chat template's shared prefix is
    cached there, and the router routes by it): the one whose prefix-cache queries move when
    one of them is sent."""
    def queries() -> list[int]:
        return [worker_stats(a, "prefill").prefix_cache_queries for a in cluster.prefill_addresses]

    before = queries()
    collect(stub.Generate(chat_request(PROMPTS[0], 1), timeout=60))
    moved = [after - b for after, b in zip(queries(), before)]
    return cluster.prefill[moved.index(max(moved))]


def test_a_holder_that_never_sends_costs_no_request(cluster, stub, undisturbed_ids):
    """The holder's block server accepts the read and sends nothing: the read fails after
    transfer_timeout_s, counted, and the request is prefilled again and completes."""
    holder = serving_prefill(cluster, stub)
    before = transfer_failures(cluster)
    ray.get(holder.inject_fault.remote("holder_stall"), timeout=10)
    try:
        with Load(stub, PROMPTS, MAX_TOKENS, CLIENTS, TIMEOUT_S) as load:
            until(lambda: transfer_failures(cluster) > before, "a stalled read's failure", cluster)
            load.wait_for(CLIENTS)
    finally:
        ray.get(holder.inject_fault.remote("holder_stall", False), timeout=10)
    summary = assert_each_completed_or_failed_clearly(load.outcomes, undisturbed_ids, TIMEOUT_S)
    assert not summary["errors"], summary  # a stalled holder costs no request: it is prefilled elsewhere
    assert_no_kv_held(cluster)


def test_a_reader_that_never_receives_costs_no_request(cluster, stub, undisturbed_ids):
    """The decode worker's read sends its request and never takes a byte: it times out,
    counted; the holder's blocks are freed and the request completes."""
    reader_address = cluster.decode_addresses[0]
    reader = cluster.decode[0]
    before = worker_stats(reader_address, "decode").kv_transfer_failures
    ray.get(reader.inject_fault.remote("reader_stall"), timeout=10)
    try:
        with Load(stub, PROMPTS, MAX_TOKENS, CLIENTS, TIMEOUT_S) as load:
            until(lambda: worker_stats(reader_address, "decode").kv_transfer_failures > before,
                  "a stalled read's failure", cluster)
            load.wait_for(CLIENTS)
    finally:
        ray.get(reader.inject_fault.remote("reader_stall", False), timeout=10)
    summary = assert_each_completed_or_failed_clearly(load.outcomes, undisturbed_ids, TIMEOUT_S)
    assert not summary["errors"], summary
    assert_no_kv_held(cluster)


def test_a_prefill_that_accepts_and_never_answers_costs_no_request(cluster, stub, undisturbed_ids):
    """A prefill call that is accepted and never answered (the worker's engine stays idle and it
    answers its Stats polls, so it is never found hung) is given up at its bound
    (``prefill_call_min_s`` here): the prompt goes to another prefill worker or its decode
    worker, and the silent worker is left out of routing for a while, so the requests after it
    do not each wait out the bound. Every request completes with its undisturbed tokens; nothing
    is held."""
    worker = serving_prefill(cluster, stub)
    ray.get(worker.inject_fault.remote("never_answer"), timeout=10)
    try:
        with Load(stub, PROMPTS, MAX_TOKENS, CLIENTS, TIMEOUT_S, pause_after_error_s=0.2) as load:
            until(lambda: ray.get(worker.inject_fault.remote("never_answer"), timeout=10) > 0,
                  "a call left unanswered", cluster)
            load.wait_for(2 * CLIENTS, timeout_s=TIMEOUT_S)  # the unanswered ones moved on meanwhile
    finally:
        met = ray.get(worker.inject_fault.remote("never_answer", False), timeout=10)
    summary = assert_each_completed_or_failed_clearly(load.outcomes, undisturbed_ids, TIMEOUT_S)
    assert not summary["errors"], summary
    assert met >= 1
    assert_no_kv_held(cluster)
    longest = max(o.ended - o.started for o in load.outcomes)
    print(f"never-answering prefill worker: {met} calls left unanswered; {summary['completed']} of "
          f"{len(load.outcomes)} requests completed, the longest in {longest:.1f} s")


def test_a_frozen_prefill_worker_costs_no_request(cluster, stub, undisturbed_ids):
    """A prefill worker SIGSTOPped within READ_DELAY_S of granting a claim (a read from it is
    then in flight: reads are held back that long for this test, ``reads_delayed``) and never
    continued: it is found hung, its calls and reads fail over, it is replaced; every request
    completes with its undisturbed tokens."""
    replaced = cluster._supervisor.replaced
    with (reads_delayed(cluster, READ_DELAY_S),
          Load(stub, PROMPTS, MAX_TOKENS, CLIENTS, TIMEOUT_S, pause_after_error_s=0.2) as load):
        load.wait_for(CLIENTS)
        pids = {a: pid_of(actor) for a, actor in zip(list(cluster.prefill_addresses), list(cluster.prefill))}
        address = cluster.prefill_addresses[fresh_claim(cluster, READ_DELAY_S * 0.8)]
        os.kill(pids[address], signal.SIGSTOP)
        stopped_at = time.monotonic()
        wait_replaced(cluster, "prefill", address)
        replaced_after_s = time.monotonic() - stopped_at
        load.wait_for(CLIENTS)
    summary = assert_each_completed_or_failed_clearly(load.outcomes, undisturbed_ids, TIMEOUT_S)
    assert not summary["errors"], summary
    assert gone(pids[address]) and cluster._supervisor.replaced == replaced + 1
    assert replaced_after_s < TIMEOUT_S, replaced_after_s
    spanning = load.spanning(stopped_at)
    assert spanning >= 1, "no request was in flight when the worker froze"
    assert_no_kv_held(cluster)
    print(f"frozen prefill worker: replaced after {replaced_after_s:.1f} s; {len(load.outcomes)} requests, "
          f"{spanning} in flight at the freeze, all complete; transfer timeout {TRANSFER_TIMEOUT_S:g} s")
