"""Conditional disaggregation end to end: 1 prefill + 1 decode worker, the rule on.

One short test on the default model (float32): a short prompt is prefilled by its decode
worker (no prefill work, no KV transfer) and a long one by the prefill pool (one transfer),
both equal transformers' greedy output, the decisions show in the router's metrics, and
every block is free after.
"""

import time

import grpc
import pytest

from pdserve.protos import pdserve_pb2_grpc
from pdserve.router.local_prefill import LocalPrefillConfig
from pdserve.router.limits import RouterLimits
from tests.serving.conftest import start_cluster, worker_stats
from tests.serving.test_colocated import get, wait_healthy
from tests.serving.test_disaggregated import assert_chat_greedy, chat_request, collect, reference  # noqa: F401

pytestmark = pytest.mark.slow

THRESHOLD = 64  # prompt tokens: the chat-templated short question is below, the long one above
SHORT = "Hi"
LONG = "Summarize this: " + "The quick brown fox jumps over the lazy dog. " * 12


def test_short_prompts_prefill_on_the_decode_worker_and_long_ones_on_the_prefill_pool(reference):
    # The threshold rule alone: with decode_kv_reuse on, LONG would find the chat template's
    # system prompt that SHORT left on the idle decode worker (and on no prefill worker), and the
    # reuse plan's cost model would prefill its suffix there (tests/router/test_decode_reuse.py).
    limits = RouterLimits(local_prefill=LocalPrefillConfig(max_tokens=THRESHOLD, max_load=0.5), decode_kv_reuse=False)
    cluster = start_cluster(num_prefill=1, num_decode=1, delay_s=0.0, supervise_interval_s=None,
                            router_limits=limits)
    try:
        wait_healthy(cluster.http_address)
        pre, dec = cluster.prefill_addresses[0], cluster.decode_addresses[0]
        with grpc.insecure_channel(cluster.address) as ch:
            stub = pdserve_pb2_grpc.GenerationStub(ch)
            runs = {}
            for question in (SHORT, LONG):
                before = worker_stats(pre, "prefill"), worker_stats(dec, "decode")
                ids, _, resps = collect(stub.Generate(chat_request(question, 12), timeout=120))
                after = worker_stats(pre, "prefill"), worker_stats(dec, "decode")
                assert_chat_greedy(reference, question, ids, 12)
                runs[question] = (resps[-1].usage.prompt_tokens, len(ids),
                                  after[0].num_forward_tokens - before[0].num_forward_tokens,
                                  after[1].num_forward_tokens - before[1].num_forward_tokens,
                                  after[1].kv_transfers - before[1].kv_transfers)
        prompt, n, prefill_fwd, decode_fwd, transfers = runs[SHORT]
        assert prompt < THRESHOLD and (prefill_fwd, transfers) == (0, 0) and decode_fwd == prompt + n - 1
        prompt, n, prefill_fwd, decode_fwd, transfers = runs[LONG]
        assert prompt >= THRESHOLD and prefill_fwd == prompt and transfers == 1 and decode_fwd == n - 1
        text = get(f"http://{cluster.http_address}/metrics")
        for decision, reason in (("local", "short_prompt"), ("remote", "long_prompt")):
            assert (f'pdserve:local_prefill_decisions_total{{decision="{decision}",model_name="smollm2",'
                    f'reason="{reason}"}} 1.0') in text
        deadline = time.monotonic() + 10  # the prefill worker frees its copy on the read's notice
        while worker_stats(pre, "prefill").num_blocks_used or worker_stats(dec, "decode").num_blocks_used:
            assert time.monotonic() < deadline, "blocks still in use"
            time.sleep(0.1)
    finally:
        cluster.stop()
