"""A client that drops its connection while its long prompt is being prefilled changes no one
else's answer (issue 41's report: on b4896ca the same prompt, sent again, reused blocks that
were never computed, reported them in ``cached_tokens`` and answered wrong text with HTTP 200).

A real cluster with the default model, over the OpenAI HTTP API: the prompt takes many
prefill chunks, the client closes its socket while the prefill worker is computing them, and
the same prompt sent again must answer exactly what it answers under a fresh ``cache_salt``
(which can share nothing with what came before)."""

import json
import socket
import time
import urllib.request

import pytest

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from tests.serving.conftest import start_cluster, worker_stats

pytestmark = pytest.mark.slow

CHUNK = 64  # prefill tokens a step: the prompt below takes some 20 steps
PROMPT = " ".join(f"Note {i}: the lighthouse on the {i}th rock was painted red and white." for i in range(90))


@pytest.fixture(scope="module")
def cluster():
    engine = EngineConfig(dtype="float32", cache=CacheConfig(memory_budget_bytes=192 << 20),
                          scheduler=SchedulerConfig(max_num_batched_tokens=CHUNK))
    c = start_cluster(num_prefill=1, num_decode=1, delay_s=0.0, supervise_interval_s=None, engine=engine)
    yield c
    c.stop()


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
