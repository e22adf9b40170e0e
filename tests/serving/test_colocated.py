"""``--mode colocated`` end to end: no prefill pool, each worker prefills its own requests.

One short test on the default model (float32): health is served without a prefill pool,
greedy output equals transformers token for token, a worker killed mid-stream is survived
(the router re-prefills prompt + tokens sent on the other worker, same tokens), the decision
shows in the router's metrics, and every live block is free after.
"""

import os
import signal

import pytest
import ray

from pdserve.cluster.mode import COLOCATED
from tests.helpers.chat import assert_chat_greedy, chat_request, collect
from tests.helpers.router_http import get, wait_healthy
from tests.serving.conftest import start_cluster, worker_stats

pytestmark = pytest.mark.slow

QUESTION = "Write a long story about a lighthouse keeper."


def test_colocated_serves_transformers_greedy_and_survives_a_worker_death(reference):
    import grpc

    from pdserve.protos import pdserve_pb2_grpc

    # No supervisor: the router alone must survive the dead worker.
    cluster = start_cluster(num_prefill=0, num_decode=2, delay_s=0.0, supervise_interval_s=None, mode=COLOCATED)
    try:
        assert cluster.prefill == [] and len(cluster.decode) == 2
        wait_healthy(cluster.http_address)  # no prefill pool needed
        with grpc.insecure_channel(cluster.address) as ch:
            stub = pdserve_pb2_grpc.GenerationStub(ch)
            short, _, resps = collect(stub.Generate(chat_request("Name three prime numbers.", 16), timeout=120))
            assert_chat_greedy(reference, "Name three prime numbers.", short, 16)
            stream = stub.Generate(chat_request(QUESTION, 40, ignore_eos=True), timeout=120)
            got = []
            for r in stream:
                got += list(r.token_ids)
                if len(got) >= 8:
                    break
            serving = [a for a in cluster.decode_addresses if worker_stats(a, "decode").num_running == 1]
            assert len(serving) == 1
            actor = cluster.decode[cluster.decode_addresses.index(serving[0])]
            os.kill(ray.get(actor.pid.remote()), signal.SIGKILL)
            got += collect(stream)[0]
            assert_chat_greedy(reference, QUESTION, got, 40)  # no token repeated or lost
        live = [a for a in cluster.decode_addresses if a != serving[0]]
        stats = worker_stats(live[0], "decode")
        assert stats.num_blocks_used == 0 and stats.kv_transfers == 0
        text = get(f"http://{cluster.http_address}/metrics")
        assert 'pdserve:local_prefill_decisions_total{decision="local",model_name="smollm2",reason="colocated"} 3.0' \
            in text
        assert "pdserve:request_migrations_total{model_name=\"smollm2\"} 1.0" in text
    finally:
        cluster.stop()
