"""Faults from the design's failure table, caused for real: worker processes are SIGKILLed
mid-request. Nothing a client was promised is lost, and no KV block is stranded. Here the
router learns of a dead worker from a failed call (it polls stats rarely) and the pools are
never refilled: a prefill worker dead before it answers, and a decode pool left empty. A prefill
worker killed with a read from it in flight and a decode worker killed mid-stream are the
conformance suite's (tests/faults/test_under_load.py, docs/reliability.md).

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
from tests.serving.conftest import start_cluster, worker_stats

pytestmark = pytest.mark.slow

DELAY_S = 1.0  # every KV read waits this long: time to kill a worker between two steps
NO_DECODE_DEADLINE_S = 5.0  # a stream whose decode pool died waits this out whole


@pytest.fixture(scope="module")
def cluster():
    # The router polls stats rarely here, so it learns of a dead worker from a failed call,
    # which is the path these tests are after.
    # No supervisor: these tests are about the router surviving dead workers, not their
    # replacement (tests/faults/test_rollout.py covers that).
    # No supervisor: a dead worker is never replaced, so a request that finds a pool empty
    # waits its admission budget (short here) for a replacement that never comes.
    options = dict(num_prefill=2, num_decode=1, delay_s=DELAY_S, router_poll_s=30.0, supervise_interval_s=None,
                   admission_wait_s=1.0)
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


def test_with_no_decode_worker_left_the_client_gets_unavailable(cluster, stub):
    for address in cluster.decode_addresses:
        if address not in DEAD:
            kill(cluster.decode[cluster.decode_addresses.index(address)])
            DEAD.add(address)
    time.sleep(0.5)
    # The router has not polled the dead workers yet: the prompt is prefilled and its first
    # token streamed, then the decode stream fails. With a token sent, the stream waits for a
    # replacement decode worker until the request's deadline; none comes (no supervisor here).
    # The deadline is waited out whole, so it is short: the first token comes well within it.
    stream = stub.Generate(chat_request("Hello?", 8), timeout=NO_DECODE_DEADLINE_S)
    assert next(stream).token_ids  # from the prefill worker
    with pytest.raises(grpc.RpcError) as err:
        collect(stream)
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
