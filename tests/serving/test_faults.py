"""Faults from the design's failure table, caused for real: worker processes are SIGKILLed
mid-request. Nothing a client was promised is lost, and no KV block is stranded.

On the default model, one rank per worker. What these prove is the router's: it learns of a
dead worker from a failed call and retries, re-prefills or fails clearly, whatever the worker's
rank count (a tensor-parallel worker's gRPC server is its rank 0, so its death fails the same
calls). The rank side is proved at two ranks elsewhere, on clusters that run anyway: a killed
rank 0 takes its other rank with it (``tests.serving.test_tensor_parallel``), and a decode
worker's rank 0 SIGKILLed mid-stream and a prefill worker's rank 0 killed with a read from it
in flight lose nothing (``tests.faults.test_under_load`` at tp2)."""

import os
import signal
import time

import urllib.error
import urllib.request

import grpc
import openai
import pytest
import ray

from pdserve.protos import pdserve_pb2
from tests.helpers.chat import chat_request, collect
from tests.serving.conftest import all_stats, start_cluster, worker_stats

pytestmark = pytest.mark.slow

DELAY_S = 1.0  # every KV read waits this long: time to kill a worker between two steps


@pytest.fixture(scope="module")
def cluster():
    # The router polls stats rarely here, so it learns of a dead worker from a failed call,
    # which is the path these tests are after.
    # No supervisor: these tests are about the router surviving dead workers, not their
    # replacement (tests/faults/test_rollout.py covers that).
    # No supervisor: a dead worker is never replaced, so a request that finds a pool empty
    # waits its admission budget (short here) for a replacement that never comes.
    options = dict(num_prefill=3, num_decode=2, delay_s=DELAY_S, router_poll_s=30.0, supervise_interval_s=None,
                   admission_wait_s=3.0)
    c = start_cluster(**options)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def stub(cluster):
    from pdserve.protos import pdserve_pb2_grpc

    with grpc.insecure_channel(cluster.address) as ch:
        yield pdserve_pb2_grpc.GenerationStub(ch)


def kill(actor) -> None:
    os.kill(ray.get(actor.pid.remote()), signal.SIGKILL)


def live_stats(cluster, dead: set[str]):
    return [worker_stats(a, role) for role, addrs in (("prefill", cluster.prefill_addresses),
                                                      ("decode", cluster.decode_addresses))
            for a in addrs if a not in dead]


def assert_live_blocks_free(cluster, dead: set[str], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        busy = {s.worker_id: (s.num_blocks_used, s.num_held_leases) for s in live_stats(cluster, dead)
                if s.num_blocks_used or s.num_held_leases}
        if not busy:
            return
        assert time.monotonic() < deadline, f"blocks still in use: {busy}"
        time.sleep(0.1)


DEAD: set[str] = set()
QUESTION = "Write a long story about a lighthouse keeper."


@pytest.fixture(scope="module")
def uninterrupted(stub):
    ids, _, _ = collect(stub.Generate(chat_request(QUESTION, 60, ignore_eos=True), timeout=120))
    assert len(ids) == 60
    return ids


def test_prefill_worker_dies_after_answering_before_the_pull(cluster, stub, uninterrupted):
    failures_before = sum(s.kv_transfer_failures for s in all_stats(cluster) if s.role == "decode")
    stream = stub.Generate(chat_request(QUESTION, 60, ignore_eos=True), timeout=120)
    first = next(stream)  # the KV is held now; the decode worker's read waits DELAY_S
    holder = [a for a in cluster.prefill_addresses if worker_stats(a, "prefill").num_held_leases == 1]
    assert len(holder) == 1
    kill(cluster.prefill[cluster.prefill_addresses.index(holder[0])])
    DEAD.add(holder[0])
    ids = list(first.token_ids) + collect(stream)[0]
    assert ids == uninterrupted  # the router re-prefilled elsewhere and the stream went on
    failures_after = sum(s.kv_transfer_failures for s in live_stats(cluster, DEAD) if s.role == "decode")
    assert failures_after == failures_before + 1  # counted and visible, never a silent recompute
    assert_live_blocks_free(cluster, DEAD)


def test_prefill_worker_dies_before_answering_router_retries(cluster, stub):
    victim = next(a for a in cluster.prefill_addresses if a not in DEAD)
    kill(cluster.prefill[cluster.prefill_addresses.index(victim)])
    DEAD.add(victim)
    # Sent at once, before the router's next stats poll notices: some go to the dead worker first.
    streams = [stub.Generate(chat_request(f"Say hello number {i}.", 8), timeout=120) for i in range(6)]
    for s in streams:
        ids, _, resps = collect(s)
        assert ids and resps[-1].finish_reason in (pdserve_pb2.FINISH_REASON_STOP, pdserve_pb2.FINISH_REASON_LENGTH)
    assert_live_blocks_free(cluster, DEAD)


def test_decode_worker_dies_mid_stream_and_the_stream_continues(cluster, stub, uninterrupted):
    stream = stub.Generate(chat_request(QUESTION, 60, ignore_eos=True), timeout=120)
    got = []
    for r in stream:
        got += list(r.token_ids)
        if len(got) >= 10:
            break
    serving = [a for a in cluster.decode_addresses if worker_stats(a, "decode").num_running == 1]
    assert len(serving) == 1
    kill(cluster.decode[cluster.decode_addresses.index(serving[0])])
    DEAD.add(serving[0])
    got += collect(stream)[0]
    assert got == uninterrupted  # no token repeated or lost
    assert_live_blocks_free(cluster, DEAD)


def test_with_no_decode_worker_left_the_client_gets_unavailable(cluster, stub):
    for address in cluster.decode_addresses:
        if address not in DEAD:
            kill(cluster.decode[cluster.decode_addresses.index(address)])
            DEAD.add(address)
    time.sleep(0.5)
    # The router has not polled the dead workers yet: the prompt is prefilled and its first
    # token streamed, then the decode stream fails. With a token sent, the stream waits for a
    # replacement decode worker until the request's deadline; none comes (no supervisor here).
    with pytest.raises(grpc.RpcError) as err:
        collect(stub.Generate(chat_request("Hello?", 8), timeout=10))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_live_blocks_free(cluster, DEAD)  # the prefill side freed what nobody will pull
    # The HTTP front says the same: 503 on /health and on a completion, in OpenAI's shape.
    client = openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIStatusError) as http_err:
        client.completions.create(model="smollm2", prompt="Hello?", max_tokens=4)
    assert http_err.value.status_code == 503 and "decode" in http_err.value.message
    with pytest.raises(urllib.error.HTTPError) as health:
        urllib.request.urlopen(f"http://{cluster.http_address}/health", timeout=10)
    assert health.value.code == 503
