"""A client that stops reading its stream: it keeps the connection open and takes no byte. The
request ends by its deadline (``X-Request-Timeout``), is aborted on its workers and its KV
freed, while the client still holds the connection; the other requests go on with their
undisturbed tokens. (Loopback buffers take about 1.7 MB of a stream that nobody reads before a
write waits, far more than a CPU decodes here in seconds; a write that does wait ends the
stream after ``stream_idle_timeout_s``: tests/router/test_loop_isolation.py.)"""

import json
import socket
import time

import pytest

from tests.helpers.chat import chat_request, collect
from tests.helpers.faults import assert_no_kv_held, busy
from tests.helpers.under_load import MAX_TOKENS, PROMPTS

pytestmark = pytest.mark.slow

LONG_TOKENS = 2000  # far more than a CPU decodes within ENDED_WITHIN_S: a request that ended was cut
DEADLINE_S = 6.0  # the unread request's own deadline
ENDED_WITHIN_S = 20.0


def unread_stream(http_address: str) -> socket.socket:
    """A streamed chat completion, with a deadline of ``DEADLINE_S``, asked for over a socket
    that will never be read (its receive buffer as small as the kernel allows; each chunk
    large, with 20 top logprobs)."""
    host, port = http_address.rsplit(":", 1)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.connect((host, int(port)))
    body = json.dumps({"model": "smollm2", "messages": [{"role": "user", "content": PROMPTS[2]}],
                       "max_tokens": LONG_TOKENS, "ignore_eos": True, "stream": True,
                       "logprobs": True, "top_logprobs": 20}).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                 b"X-Request-Timeout: %g\r\nContent-Length: %d\r\n\r\n" % (host.encode(), DEADLINE_S, len(body)) + body)
    return sock


def test_a_client_that_stops_reading_holds_no_kv(cluster, stub, undisturbed_ids):
    sock = unread_stream(cluster.http_address)
    try:
        started = time.monotonic()
        busy(cluster.decode_addresses)  # it is being decoded
        ids, _, _ = collect(stub.Generate(chat_request(PROMPTS[0], MAX_TOKENS, ignore_eos=True), timeout=60))
        assert ids == undisturbed_ids[0]  # others are served meanwhile, with their tokens
        assert_no_kv_held(cluster)  # ...and the unread one ended: nothing is held, the socket still open
        ended_s = time.monotonic() - started
        assert ended_s < ENDED_WITHIN_S, ended_s
    finally:
        sock.close()
    print(f"unread stream: KV free {ended_s:.1f} s after the request (its deadline {DEADLINE_S:g} s)")
