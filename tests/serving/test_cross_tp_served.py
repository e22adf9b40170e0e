"""Served clusters whose pools run different tensor-parallel sizes (prefill TP 2 -> decode TP 1,
and 1 -> 2): Ray places each worker's ranks, rank 0 creates every rank's KV agent, and each
decode rank reads its KV heads from the prefill ranks that hold them, whole or streamed. Each
cluster is its own (one Ray cluster at a time: the TP 2 cluster of test_tensor_parallel.py is
module-scoped there)."""

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


@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2)], ids=["tp2-to-tp1", "tp1-to-tp2"])
def test_pools_of_different_tp_serve_transformers_greedy(tool_llama, prefill_tp, decode_tp):
    """The KV moves by head between the pools (streamed and whole), every decode rank reading its
    heads from the prefill ranks that hold them: the tokens are transformers' and no read fails
    (each rank's bytes against what it computes: tests/decode_worker/test_cross_tp.py)."""
    from transformers import AutoTokenizer

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
