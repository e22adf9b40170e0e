"""The tcp block server refuses before it allocates, and drops idle readers (issue 25): a raw
socket speaks the READ frame with hostile counts, or goes silent. Each answer is the holder's
ERROR naming the field and the limit, sent before the sender's block ids, which it never
sends; the old server sized a buffer by ``n_blocks`` first and waited for them forever."""

import socket
import struct
import time

import pytest
import torch

from pdserve.kv_transfer import tcp_wire

NUM_BLOCKS, BLOCK_BYTES = 8, 64
TOKEN = b"lease-token"


def block_server(io_timeout_s: float = 0.5, **caps) -> tcp_wire.BlockServer:
    blocks = torch.arange(NUM_BLOCKS * BLOCK_BYTES, dtype=torch.int64).to(torch.uint8).reshape(NUM_BLOCKS, BLOCK_BYTES)
    claimed = {TOKEN: set(range(4))}
    return tcp_wire.BlockServer("127.0.0.1", 0, blocks, on_notify=lambda n: None,
                                authorize=lambda notify, ids: notify in claimed and set(ids) <= claimed[notify],
                                io_timeout_s=io_timeout_s, **caps)


@pytest.fixture
def server():
    srv = block_server()
    yield srv
    srv.close()


def connect(srv) -> socket.socket:
    host, port = srv.address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=60)  # only a bound against a hang


def refusal(sock: socket.socket) -> str:
    status, length = tcp_wire.REPLY_HEADER.unpack(tcp_wire.recv_exact(sock, tcp_wire.REPLY_HEADER.size))
    assert status == tcp_wire.STATUS_ERROR
    return tcp_wire.recv_exact(sock, length).decode()


@pytest.mark.parametrize("n_blocks,notify,last,words", [
    (2**32 - 1, TOKEN, BLOCK_BYTES, f"n_blocks 4294967295 is not in (0, {NUM_BLOCKS}]"),
    (0, TOKEN, BLOCK_BYTES, "n_blocks 0"),
    (2, TOKEN, BLOCK_BYTES + 1, f"not in (0, {BLOCK_BYTES}]"),
    (2, b"not-a-lease", BLOCK_BYTES, "no claimed lease"),
])
def test_a_hostile_header_is_refused_before_the_block_ids_are_read(server, n_blocks, notify, last, words):
    with connect(server) as sock:
        # The header and the notify only: the ids never come.
        sock.sendall(tcp_wire.READ_HEADER.pack(tcp_wire.READ_MAGIC, n_blocks, len(notify), last) + notify)
        assert words in refusal(sock)


def test_a_notify_over_the_limit_is_refused_before_it_is_read(server):
    with connect(server) as sock:
        sock.sendall(tcp_wire.READ_HEADER.pack(tcp_wire.READ_MAGIC, 1, 2**32 - 1, BLOCK_BYTES))
        assert f"MAX_NOTIFY_BYTES={tcp_wire.MAX_NOTIFY_BYTES}" in refusal(sock)


@pytest.mark.parametrize("sent", [b"", tcp_wire.READ_HEADER.pack(tcp_wire.READ_MAGIC, 2, len(TOKEN), 8)[:7]])
def test_a_silent_reader_is_dropped(server, sent):
    with connect(server) as sock:
        sock.sendall(sent)
        assert sock.recv(64) == b""  # the holder closed the connection on its io timeout


def test_a_reader_that_never_acknowledges_is_dropped(server):
    with connect(server) as sock:
        sock.sendall(tcp_wire.encode_read([1, 2], TOKEN, BLOCK_BYTES))
        status, length = tcp_wire.REPLY_HEADER.unpack(tcp_wire.recv_exact(sock, tcp_wire.REPLY_HEADER.size))
        assert (status, length) == (tcp_wire.STATUS_OK, 2 * BLOCK_BYTES)
        assert tcp_wire.recv_exact(sock, length) == bytes(range(64, 192))  # blocks 1 and 2
        assert sock.recv(64) == b""  # no ACK from us: the holder gave up, nothing recorded


def test_an_honest_read_still_works(server):
    honest_read(server)


def honest_read(srv) -> None:
    """A read of block 3's first 16 bytes under the claimed lease, acknowledged: served."""
    with connect(srv) as sock:
        sock.sendall(tcp_wire.encode_read([3], TOKEN, 16))
        tcp_wire.recv_reply_header(sock, 16)
        assert tcp_wire.recv_exact(sock, 16) == bytes(range(192, 208))
        sock.sendall(tcp_wire.ACK_MAGIC)
        assert struct.unpack("!B", tcp_wire.recv_exact(sock, 1))[0] == tcp_wire.STATUS_OK


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + 30  # only a bound against a hang
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def closed_at_once(srv) -> bool:
    """A new connection is closed by the holder without a byte (the 30 s bound only ends a
    hang: the old server gave every connection a thread that waited for its READ)."""
    with connect(srv) as sock:
        sock.settimeout(30)
        return sock.recv(64) == b""


def test_connections_past_the_unauthenticated_cap_are_closed_before_they_get_a_thread():
    srv = block_server(io_timeout_s=60, max_connections=8, max_unauthenticated=3)
    try:
        idle = [connect(srv) for _ in range(3)]  # connected, silent: no token shown
        wait_for(lambda: srv.admission.unauthenticated == 3, "three idle connections held")
        assert closed_at_once(srv)
        assert (srv.admission.refused, srv.admission.open) == (1, 3)
        for sock in idle:
            sock.close()
        wait_for(lambda: srv.admission.open == 0, "the idle connections given back")
        honest_read(srv)  # room again: a reader with a claimed lease is served
        assert srv.admission.refused == 1
    finally:
        srv.close()


def test_connections_past_the_total_cap_are_closed_even_when_authorized_ones_hold_them():
    srv = block_server(io_timeout_s=60, max_connections=2, max_unauthenticated=2)
    try:
        stalled = [connect(srv) for _ in range(2)]
        for sock in stalled:  # authorized reads that never take their blocks nor acknowledge
            sock.sendall(tcp_wire.encode_read([1], TOKEN, BLOCK_BYTES))
        wait_for(lambda: (srv.admission.open, srv.admission.unauthenticated) == (2, 0), "two authorized reads")
        assert closed_at_once(srv)
        assert srv.admission.refused == 1
        for sock in stalled:
            sock.close()
        wait_for(lambda: srv.admission.open == 0, "the stalled reads given back")
        honest_read(srv)
    finally:
        srv.close()


def test_the_caps_are_checked():
    with pytest.raises(ValueError, match="max_unauthenticated must be in"):
        block_server(max_connections=2, max_unauthenticated=3)
