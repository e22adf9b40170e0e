"""Prefill that keeps up, end to end (docs/routing.md#prefill-that-keeps-up): 1 prefill + 1
decode worker, the default model in float32, the overflow threshold near zero so that a
prompt arriving while the prefill worker still computes another is prefilled by its decode
worker. Real workers, NIXL, the router's own pace and queue view; nothing is mocked.

The sequence is fixed by what the router can know:
1. a first prompt: no prefill answer seen yet, so no pace, so the prefill pool (``off``);
2. a long prompt A: the prefill worker is idle, so it is no later there (``off``);
3. while A's 64-token chunks are computing, a prompt B: the prefill worker has A's tokens still
   to compute, the decode worker none, so B is prefilled by the decode worker
   (``prefill_behind``).
Every answer equals transformers' greedy one, and every block is free after.
"""

import concurrent.futures
import time

import grpc
import pytest

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.protos import pdserve_pb2_grpc
from pdserve.router.limits import RouterLimits
from pdserve.router.local_prefill import LocalPrefillConfig
from tests.helpers.chat import assert_chat_greedy, chat_request, collect
from tests.helpers.router_http import decisions, wait_healthy
from tests.serving.conftest import start_cluster, worker_stats

pytestmark = pytest.mark.slow

CHUNK = 64  # prefill tokens a step: A takes some 20 steps, long after B is planned
FIRST = "What is the capital of France?"
LONG = " ".join(f"Note {i}: the lighthouse on the {i}th rock was painted red and white." for i in range(80))
B = "Name three colours of the rainbow."


@pytest.fixture(scope="module")
def cluster():
    engine = EngineConfig(dtype="float32", cache=CacheConfig(memory_budget_bytes=192 << 20),
                          scheduler=SchedulerConfig(max_num_batched_tokens=CHUNK))
    # Any predicted wait past a millisecond is "behind"; a decode worker's token costs what a
    # prefill worker's does, so B goes local exactly when the prefill worker has more to do.
    # decode_kv_reuse off: the chat template's system prompt on the decode worker would plan B
    # by the reuse costs instead (tests/router/test_decode_reuse.py).
    limits = RouterLimits(local_prefill=LocalPrefillConfig(overflow_ttft_s=1e-3, overflow_slowdown=1.0),
                          decode_kv_reuse=False)
    c = start_cluster(num_prefill=1, num_decode=1, delay_s=0.0, supervise_interval_s=None, engine=engine,
                      router_limits=limits)
    try:
        wait_healthy(c.http_address)
        yield c
    finally:
        c.stop()


def test_a_prompt_behind_a_busy_prefill_worker_is_prefilled_by_its_decode_worker(cluster, reference):
    pre, dec = cluster.prefill_addresses[0], cluster.decode_addresses[0]
    counted = decisions(cluster.http_address)
    with grpc.insecure_channel(cluster.address) as ch:
        stub = pdserve_pb2_grpc.GenerationStub(ch)

        def ask(question):
            return collect(stub.Generate(chat_request(question, 12), timeout=300))[0]

        assert_chat_greedy(reference, FIRST, ask(FIRST), 12)  # the router learns a token's cost here
        before = worker_stats(dec, "decode")
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            long = pool.submit(ask, LONG)
            deadline = time.monotonic() + 60
            while worker_stats(pre, "prefill").num_waiting_tokens == 0:  # A is on the prefill worker
                assert time.monotonic() < deadline and not long.done(), "A never showed as work to do"
                time.sleep(0.05)
            time.sleep(0.5)  # past the router's next stats poll (0.2 s)
            short = pool.submit(ask, B)
            long_ids, short_ids = long.result(), short.result()
        after = worker_stats(dec, "decode")
    assert_chat_greedy(reference, LONG, long_ids, 12)
    assert_chat_greedy(reference, B, short_ids, 12)
    now = decisions(cluster.http_address)
    added = {key: value - counted.get(key, 0.0) for key, value in now.items() if value != counted.get(key, 0.0)}
    assert added == {("remote", "off"): 2.0, ("local", "prefill_behind"): 1.0}
    assert after.kv_transfers - before.kv_transfers == 1  # A's KV moved; B's was computed where it decodes
    deadline = time.monotonic() + 10  # the prefill worker frees its copy on the read's notice
    while worker_stats(pre, "prefill").num_blocks_used or worker_stats(dec, "decode").num_blocks_used:
        assert time.monotonic() < deadline, "blocks still in use"
        time.sleep(0.1)
