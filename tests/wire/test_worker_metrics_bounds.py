"""A worker's ``/metrics`` server is an internal server like the others: it binds beyond
loopback only with mTLS (``check_bind``), drops a connection that sends nothing, and serves a
bounded number of connections at once (``pdserve.wire.worker_metrics``)."""

import socket
import time
import urllib.request

import pytest

from pdserve.protos import worker_pb2
from pdserve.wire import worker_metrics
from pdserve.wire.internal_plane import InsecureInternalError


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server ended the connection without an answer (a FIN, or a reset when it
    closed with our request unread)."""
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True


def source(name: str) -> worker_metrics.WorkerSource:
    return worker_metrics.WorkerSource("decode", name, worker_pb2.WorkerStats, 16)


def test_metrics_beyond_loopback_without_mtls_is_refused():
    with pytest.raises(InsecureInternalError, match="/metrics"):
        worker_metrics.serve_worker("0.0.0.0", 0, source("decode-wild"))


def test_metrics_beyond_loopback_by_choice_serves():
    ep = worker_metrics.serve_worker("0.0.0.0", 0, source("decode-insecure"), insecure_internal=True)
    try:
        port = ep.address.rsplit(":", 1)[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            assert resp.status == 200
    finally:
        ep.stop()


def test_a_connection_that_sends_nothing_is_closed():
    """Old code: no timeout, the connection (and its thread) lived as long as the peer liked."""
    ep = worker_metrics.serve_worker("127.0.0.1", 0, source("decode-silent"), timeout_s=0.3)
    host, port = ep.address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(b"GET /metrics HTTP/1.1\r\n")  # and never the rest of the headers
            assert closed_by_server(sock)  # long before the client's own 30 s
    finally:
        ep.stop()


def test_connections_past_the_cap_are_closed_while_scrapes_still_answer_after():
    ep = worker_metrics.serve_worker("127.0.0.1", 0, source("decode-many"), timeout_s=60.0)  # held till closed
    host, port = ep.address.rsplit(":", 1)
    held = [socket.create_connection((host, int(port)), timeout=30)
            for _ in range(worker_metrics.MAX_METRICS_CONNECTIONS)]
    try:
        with socket.create_connection((host, int(port)), timeout=30) as extra:
            extra.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            assert closed_by_server(extra)  # every slot is held
    finally:
        for sock in held:
            sock.close()
    try:
        for _ in range(50):  # the held slots free as their connections close
            try:
                with urllib.request.urlopen(f"http://{ep.address}/metrics", timeout=5) as resp:
                    assert resp.status == 200
                    break
            except OSError:
                time.sleep(0.1)
        else:
            pytest.fail("the endpoint never answered again after the held connections closed")
    finally:
        ep.stop()
