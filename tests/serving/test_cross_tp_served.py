"""A served cluster whose pools run different tensor-parallel sizes (prefill TP 1 -> decode TP 2):
Ray places each worker's ranks, rank 0 creates every rank's KV agent, and each decode rank reads
its KV heads from the prefill rank that holds them, whole or streamed. Its own cluster (one Ray
cluster at a time: the TP 2 cluster of test_tensor_parallel.py is module-scoped there).

One direction is served end to end; both are checked where they differ. The KV by head at
(2, 1) and (1, 2), over NIXL and tcp, whole and streamed, with transformers' tokens:
tests/decode_worker/test_cross_tp.py (real workers behind their gRPC servers, the router's real
request run). Each pool's size and the prefill worker's reader size from the settings:
tests/cluster/test_tp_settings.py. A TP 2 prefill worker's ranks placed by Ray and serving:
test_tensor_parallel.py. (This module also served 2 -> 1 on a cluster of its own until
2026-11-29.)"""

import pytest
import torch

from pdserve.engine.config import SchedulerConfig
from pdserve.router.limits import RouterLimits
from tests.clusters import reconnecting_stub
from tests.factories import assert_greedy_matches, load_reference
from tests.helpers.chat import chat_request, collect
from tests.helpers.tensor_parallel import CHUNK, LONG, MAX_TOKENS, STREAMED, tp_cluster
from tests.serving.conftest import all_stats

pytestmark = pytest.mark.slow


def test_pools_of_different_tp_serve_transformers_greedy(tool_llama):
    """The KV moves by head between the pools (streamed and whole), every decode rank reading its
    heads from the prefill ranks that hold them: the tokens are transformers' and no read fails
    (each rank's bytes against what it computes: tests/decode_worker/test_cross_tp.py)."""
    from transformers import AutoTokenizer

    prefill_tp, decode_tp = 1, 2
    directory = tool_llama[0]
    model, tok = load_reference(directory, torch.float32), AutoTokenizer.from_pretrained(str(directory))
    c = tp_cluster(directory, prefill_tp, SchedulerConfig(max_num_batched_tokens=CHUNK), decode_tp=decode_tp,
                   num_prefill=1, num_decode=1, delay_s=0.0, router_limits=RouterLimits(stream_kv_min_tokens=STREAMED))
    try:
        with reconnecting_stub(c.address) as stub:
            for question in ["Hi", LONG]:
                ids, _, _ = collect(stub.Generate(chat_request(question, MAX_TOKENS, ignore_eos=True), timeout=120))
                text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                               add_generation_prompt=True)
                assert_greedy_matches(model, tok.encode(text, add_special_tokens=False), ids, MAX_TOKENS, what=question)
        stats = all_stats(c)
        assert sum(s.kv_transfers for s in stats if s.role == "decode") >= 2 * max(prefill_tp, decode_tp)
        assert sum(s.kv_transfer_failures + s.kv_verify_failures for s in stats) == 0
    finally:
        c.stop()
