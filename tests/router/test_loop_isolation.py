"""The router's event loop never waits on a client (router.client_work, http_api, auth): large
bodies are parsed and every tokenizer call runs on the tokenizer threads, whose queue is
bounded (429 + Retry-After); every path but /health and /metrics needs the API key; clients
that send their headers or body too slowly are dropped. Over fake workers, real aiohttp."""

import asyncio
import json
import socket
import threading
from types import SimpleNamespace

import pytest

from pdserve.router import http_api
from pdserve.router.client_work import INLINE_BYTES
from pdserve.router.auth import ApiKeys
from tests.helpers.http_front import request, serve_in_thread, service_with
from tests.metrics.metrics_helpers import LetterTokenizer

FLOOD = 20
BIG_TOKENS = [700] * 4000  # ~20 KB of JSON: above INLINE_BYTES, within max_model_len


class RecordingTokenizer(LetterTokenizer):
    """Records the thread of every whole-text decode (``hf``): echo and logprob strings."""

    def __init__(self):
        self.threads: list[str] = []
        self.hf = SimpleNamespace(decode=self.hf_decode, batch_decode=self.batch_decode)

    def batch_decode(self, batch) -> list[str]:
        self.threads.append(threading.current_thread().name)
        return [LetterTokenizer.decode(self, ids) for ids in batch]

    def hf_decode(self, ids) -> str:
        self.threads.append(threading.current_thread().name)
        return LetterTokenizer.decode(self, ids)


class Gate:
    """Stands in for ``decode_json``: a large body's parse waits on ``release`` (at most
    ``wait_s``) and records whether it was released in time."""

    def __init__(self, monkeypatch, wait_s: float = 30.0):
        self.real, self.wait_s = http_api.decode_json, wait_s
        self.entered, self.release, self.released = threading.Event(), threading.Event(), []
        monkeypatch.setattr(http_api, "decode_json", self)

    def __call__(self, raw: bytes):
        if len(raw) > INLINE_BYTES:
            self.entered.set()
            self.released.append(self.release.wait(self.wait_s))
        return self.real(raw)


def test_health_is_answered_while_a_flood_of_large_bodies_is_being_parsed(monkeypatch):
    gate = Gate(monkeypatch)
    address, stop = serve_in_thread(service_with())
    body = json.dumps({"tokens": BIG_TOKENS}).encode()
    statuses = []
    flood = [threading.Thread(target=lambda: statuses.append(request(address, "POST", "/detokenize", body)[0]))
             for _ in range(FLOOD)]
    try:
        for t in flood:
            t.start()
        assert gate.entered.wait(60), "no large body was parsed"
        health = request(address, "GET", "/health")[0]  # while the first body's parse is held
        gate.release.set()
        for t in flood:
            t.join(120)
    finally:
        gate.release.set()
        stop()
    assert health in (200, 503)
    # Every parse was still in flight when /health had been answered: none held the loop.
    assert len(gate.released) == FLOOD and all(gate.released), gate.released
    assert statuses == [200] * FLOOD


def test_a_full_tokenizer_queue_is_429_with_retry_after_and_the_queued_call_completes(monkeypatch):
    gate = Gate(monkeypatch)
    address, stop = serve_in_thread(service_with(max_tokenizer_queue=1, retry_after_s=3))
    big = json.dumps({"tokens": BIG_TOKENS}).encode()
    first = {}
    thread = threading.Thread(target=lambda: first.update(r=request(address, "POST", "/detokenize", big)))
    try:
        thread.start()
        assert gate.entered.wait(60)
        refused = request(address, "POST", "/tokenize", json.dumps({"prompt": "hi"}).encode())
        generate = request(address, "POST", "/v1/completions", json.dumps({"prompt": [5], "max_tokens": 1}).encode())
        gate.release.set()
        thread.join(120)
    finally:
        gate.release.set()
        stop()
    status, retry_after, payload = refused
    assert (status, retry_after) == (429, "3") and b"max_tokenizer_queue=1" in payload
    assert generate[:2] == (429, "3")  # a generation's prompt is tokenizer work too
    assert first["r"][0] == 200 and len(json.loads(first["r"][2])["prompt"]) == len(BIG_TOKENS)


@pytest.mark.parametrize("method,path", [("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/version"),
                                         ("GET", "/metrics/targets"), ("GET", "/v1/models")])
def test_every_path_but_health_and_metrics_needs_the_api_key(method, path):
    service = service_with()
    service.keys = ApiKeys.single("sesame")
    address, stop = serve_in_thread(service)
    body = json.dumps({"tokens": [1]}).encode() if method == "POST" else None
    try:
        refused = request(address, method, path, body)
        allowed = request(address, method, path, body, {"Authorization": "Bearer sesame"})
        open_paths = [request(address, "GET", p)[0] for p in ("/health", "/metrics")]
    finally:
        stop()
    assert refused[0] == 401 and allowed[0] != 401
    assert 401 not in open_paths


@pytest.mark.parametrize("stream", [False, True])
def test_echo_and_logprobs_decode_on_the_tokenizer_thread_not_the_loop(stream):
    tok = RecordingTokenizer()
    address, stop = serve_in_thread(service_with(tok))
    body = {"prompt": [3, 4, 5], "max_tokens": 3, "echo": True, "logprobs": 2, "stream": stream}
    try:
        status, _, payload = request(address, "POST", "/v1/completions", json.dumps(body).encode())
    finally:
        stop()
    assert status == 200, payload
    assert b"def" in payload  # the echoed prompt's text
    assert tok.threads and all(name.startswith("pdserve-tokenize") for name in tok.threads), tok.threads


def test_a_client_that_never_finishes_its_headers_is_disconnected():
    address, stop = serve_in_thread(service_with(http_header_timeout_s=0.5))
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=60) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and never the rest
            answer = sock.recv(4096)  # blocks until the router closes the connection
    finally:
        stop()
    assert answer == b""


def test_a_body_that_stops_arriving_is_408_naming_the_limit():
    address, stop = serve_in_thread(service_with(http_body_timeout_s=0.5))
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=60) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"prompt\"")  # 9 of 100 bytes, then silence
            answer = sock.recv(4096)
    finally:
        stop()
    assert answer.startswith(b"HTTP/1.1 408") and b"http_body_timeout_s=0.5" in answer


def test_a_detokenize_body_longer_than_any_context_is_refused_before_it_is_parsed(monkeypatch):
    gate = Gate(monkeypatch)
    address, stop = serve_in_thread(service_with())
    try:
        status, _, payload = request(address, "POST", "/detokenize", json.dumps({"tokens": [1] * 30000}).encode())
    finally:
        stop()
    assert status == 400 and b"detokenize_max_bytes=" in payload
    assert not gate.entered.is_set()  # never parsed


def test_a_stream_write_the_client_never_takes_ends_the_stream():
    """A client that stops reading fills the socket, and a write then waits for it: past
    stream_idle_timeout_s the handler gives up (which aborts the request on the workers)."""
    class StuckResponse:  # a write that waits for a reader that never reads
        async def write(self, data: bytes) -> None:
            await asyncio.Event().wait()

    with pytest.raises(ConnectionResetError, match="stream_idle_timeout_s=0.1"):
        asyncio.run(http_api._write(StuckResponse(), b"data: x\n\n", 0.1))
