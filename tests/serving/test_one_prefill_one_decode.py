"""Two end-to-end checks on one cluster: 1 prefill + 1 decode worker, the default model in
float32, prefill in chunks of 64 tokens, conditional disaggregation on below 64 prompt tokens.
They share the cluster (one start, not two) because neither changes what the other sees: each
measures its own requests by before/after differences and leaves every block free.

1. Conditional disaggregation: a short prompt is prefilled by its decode worker (no prefill
   work, no KV transfer) and a long one by the prefill pool (one transfer), both equal
   transformers' greedy output, the decisions show in the router's metrics, and every block is
   free after.
2. A client that drops its connection while its long prompt is being prefilled changes no one
   else's answer (issue 41's report: on b4896ca the same prompt, sent again, reused blocks that
   were never computed, reported them in ``cached_tokens`` and answered wrong text with HTTP
   200). Over the OpenAI HTTP API: the prompt takes many prefill chunks, the client closes its
   socket while the prefill worker is computing them, and the same prompt sent again must
   answer exactly what it answers under a fresh ``cache_salt`` (which can share nothing with
   what came before).
"""

import json
import os
import signal
import socket
import threading
import time
import urllib.request

import grpc
import pytest
import ray

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.protos import pdserve_pb2_grpc
from pdserve.router.limits import RouterLimits
from pdserve.router.local_prefill import LocalPrefillConfig
from tests.helpers.chat import assert_chat_greedy, chat_request, collect
from tests.helpers.router_http import decisions, wait_healthy
from tests.serving.conftest import start_cluster, worker_stats

pytestmark = pytest.mark.slow

CHUNK = 64  # prefill tokens a step: the dropped prompt below takes some 20 steps
THRESHOLD = 64  # prompt tokens: the chat-templated short question is below, the long one above
SHORT = "Hi"
LONG = "Summarize this: " + "The quick brown fox jumps over the lazy dog. " * 12
PROMPT = " ".join(f"Note {i}: the lighthouse on the {i}th rock was painted red and white." for i in range(90))


@pytest.fixture(scope="module")
def cluster():
    engine = EngineConfig(dtype="float32", cache=CacheConfig(memory_budget_bytes=192 << 20),
                          scheduler=SchedulerConfig(max_num_batched_tokens=CHUNK))
    # The threshold rule alone: with decode_kv_reuse on, LONG would find the chat template's
    # system prompt that SHORT left on the idle decode worker (and on no prefill worker), and the
    # reuse plan's cost model would prefill its suffix there (tests/router/test_decode_reuse.py).
    # A prefill call gives up on a silent worker after 4 s (10 s by default): test 3 waits that long.
    limits = RouterLimits(local_prefill=LocalPrefillConfig(max_tokens=THRESHOLD, max_load=0.5), decode_kv_reuse=False,
                          prefill_call_min_s=4.0)
    c = start_cluster(num_prefill=1, num_decode=1, delay_s=0.0, supervise_interval_s=None, engine=engine,
                      router_limits=limits)
    try:
        wait_healthy(c.http_address)
        yield c
    finally:
        c.stop()


def test_short_prompts_prefill_on_the_decode_worker_and_long_ones_on_the_prefill_pool(cluster, reference):
    pre, dec = cluster.prefill_addresses[0], cluster.decode_addresses[0]
    counted = decisions(cluster.http_address)
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
    now = decisions(cluster.http_address)
    added = {key: value - counted.get(key, 0.0) for key, value in now.items() if value != counted.get(key, 0.0)}
    assert added == {("local", "short_prompt"): 1.0, ("remote", "long_prompt"): 1.0}
    deadline = time.monotonic() + 10  # the prefill worker frees its copy on the read's notice
    while worker_stats(pre, "prefill").num_blocks_used or worker_stats(dec, "decode").num_blocks_used:
        assert time.monotonic() < deadline, "blocks still in use"
        time.sleep(0.1)


def prefill_stats(cluster):
    return worker_stats(cluster.prefill_addresses[0], "prefill")


def complete(cluster, salt: str | None = None) -> dict:
    body = {"model": "smollm2", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    if salt is not None:
        body["cache_salt"] = salt
    req = urllib.request.Request(f"http://{cluster.http_address}/v1/completions", json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        assert resp.status == 200
        return json.loads(resp.read())


def wait_until(predicate, timeout_s: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def drop_mid_prefill(cluster) -> int:
    """Stream the prompt, close the socket once the prefill worker is computing it, wait for
    the abort to free its blocks; returns the prompt tokens the worker ran meanwhile."""
    before = prefill_stats(cluster).num_forward_tokens
    host, port = cluster.http_address.rsplit(":", 1)
    body = json.dumps({"model": "smollm2", "prompt": PROMPT, "max_tokens": 12, "stream": True}).encode()
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        wait_until(lambda: prefill_stats(cluster).num_forward_tokens > before, what="the first chunk")
    idle = lambda: (lambda s: s.num_running == 0 and s.num_waiting == 0 and s.num_blocks_used == 0)(prefill_stats(cluster))  # noqa: E731
    wait_until(idle, what="the dropped request's blocks to be freed")
    return prefill_stats(cluster).num_forward_tokens - before


def test_a_prompt_dropped_between_chunks_leaves_every_later_answer_right(cluster):
    computed = drop_mid_prefill(cluster)
    again = complete(cluster)
    prompt_tokens = again["usage"]["prompt_tokens"]
    assert CHUNK <= computed < prompt_tokens - CHUNK, "the drop must land while the prompt is computing"
    fresh = complete(cluster, salt="never-used-before")
    assert again["choices"][0]["text"] == fresh["choices"][0]["text"]
    assert again["choices"][0]["finish_reason"] == fresh["choices"][0]["finish_reason"] == "length"
    cached = again["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
    assert cached <= computed  # never more than any prefill computed


FROZEN_QUESTIONS = [f"Summarize note {i}: " + "The quick brown fox jumps over the lazy dog. " * 10 for i in range(3)]
DEADLINE_S = 90.0  # each stream's gRPC deadline


def test_a_frozen_prefill_worker_costs_no_stream(cluster, reference):
    counted = decisions(cluster.http_address)
    pid = ray.get(cluster.prefill[0].pid.remote())
    results: dict[int, object] = {}

    def stream(i: int, question: str) -> None:
        start = time.monotonic()
        try:
            with grpc.insecure_channel(cluster.address) as ch:
                ids, _, _ = collect(pdserve_pb2_grpc.GenerationStub(ch).Generate(chat_request(question, 6),
                                                                                timeout=DEADLINE_S))
            results[i] = (ids, time.monotonic() - start)
        except grpc.RpcError as exc:
            results[i] = exc

    threads = [threading.Thread(target=stream, args=(i, q)) for i, q in enumerate(FROZEN_QUESTIONS)]
    for t in threads:
        t.start()
    try:
        # Every prompt is long (remote) and takes the prefill worker seconds in float32: frozen
        # 0.3 s in, it holds all of them, queued or computing.
        time.sleep(0.3)
        os.kill(pid, signal.SIGSTOP)
        for t in threads:
            t.join(DEADLINE_S + 10)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert all(not isinstance(r, Exception) for r in results.values()), results
    assert len(results) == len(FROZEN_QUESTIONS)
    for i, question in enumerate(FROZEN_QUESTIONS):
        ids, took = results[i]
        assert_chat_greedy(reference, question, ids, 6)
        assert took < DEADLINE_S / 2, f"stream {i} took {took:.1f} s"
    added = {key: value - counted.get(key, 0.0) for key, value in decisions(cluster.http_address).items()}
    assert added.get(("local", "no_prefill_worker"), 0) >= 1, added  # the decode worker prefilled
    deadline = time.monotonic() + 30  # the thawed worker's leases end; nothing is held after
    pre, dec = cluster.prefill_addresses[0], cluster.decode_addresses[0]
    while worker_stats(pre, "prefill").num_blocks_used or worker_stats(dec, "decode").num_blocks_used:
        assert time.monotonic() < deadline, "blocks still in use"
        time.sleep(0.2)
