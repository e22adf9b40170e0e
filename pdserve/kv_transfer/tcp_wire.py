"""Wire format and block server of the tcp backend (one TCP connection per read).

All integers big-endian (``struct``); no pickle::

    reader -> holder  READ   "PDK3" n_blocks:u32 notify_len:u32 last_block_bytes:u64,
                             notify bytes, n_blocks x block_id:u32
                   or READ by head "PDKS" n_blocks:u32 notify_len:u32 last_block_rows:u64,
                             row_bytes:u32 offset:u32 length:u32, notify bytes, block ids
    holder -> reader  REPLY  status:u8 length:u64, then `length` bytes: the blocks in request
                             order (OK) or a utf-8 reason (ERROR)
    reader -> holder  ACK    "PDKA" once every byte has landed in the reader's blocks
    holder -> reader  status:u8 (OK) after recording ``notify``; then both sides close

A READ by head (a reader of another tensor-parallel size, ``pdserve.kv_transfer.sharding``)
asks, of each ``row_bytes`` row of each block (the last block: its first ``last_block_rows``),
the ``length`` bytes at ``offset``; the holder sends them row after row.

The holder records ``notify`` only after the ACK, so a notification always means the reader
has the data, as with NIXL.

The holder refuses before it allocates (``decode_read``): the header's counts are checked
against sane maxima (the holder's cache size, ``MAX_NOTIFY_BYTES``) and the notify (the lease
token) against the claimed leases before the block ids are read, so a sender's ``n_blocks``
(up to 2**32) never sizes a buffer. Every socket has a timeout on each read and write
(``io_timeout_s``): a reader that stops sending, or stops taking the blocks, is dropped.

With an ``ssl`` context (mTLS on the internal plane, ``pdserve.wire.tls``) every connection starts
with a TLS handshake; a reader without a certificate of the cluster's CA fails it and gets
no byte, and one whose certificate names none of ``reader_roles`` (``tcp_backend.kv_peer_roles``)
is dropped after it. The frames are the same inside TLS.

Connections are bounded before they cost a thread: the server takes at most
``max_unauthenticated`` connections that have not yet shown a claimed lease's token (the TLS
handshake and the READ header still to come), and ``max_connections`` in all; one past either
is closed as it is accepted, and counted (``refused``). A flood of idle or hostile
connections thus holds at most ``max_unauthenticated`` threads, each for at most the
handshake and I/O timeouts, and never the readers already authorized.
"""

from __future__ import annotations

import logging
import os
import socket
import socketserver
import ssl
import struct
import threading
from collections.abc import Callable, Sequence
from typing import NamedTuple, Optional

import numpy as np
import torch

from pdserve.kv_transfer.tcp_admission import Admission, Ticket
from pdserve.wire.tls import peer_roles

logger = logging.getLogger(__name__)

READ_MAGIC = b"PDK3"  # PDK3: the notify (lease token) comes before the block ids
SLICE_MAGIC = b"PDKS"  # a READ by head: PDK3's header, then a ROW_SLICE
ACK_MAGIC = b"PDKA"
STATUS_OK = 0
STATUS_ERROR = 1
READ_HEADER = struct.Struct("!4sIIQ")  # magic, blocks, notify length, last block bytes (by head: rows)
ROW_SLICE = struct.Struct("!III")  # row bytes, offset, length
REPLY_HEADER = struct.Struct("!BQ")
STATUS = struct.Struct("!B")
MAX_NOTIFY_BYTES = 1 << 16  # notifications are request ids, not payloads
_IOV_MAX = max(1, min(os.sysconf("SC_IOV_MAX"), 1024))  # buffers per sendmsg/recvmsg_into
HANDSHAKE_TIMEOUT_S = 10.0  # a connection that does not finish its TLS handshake by then is dropped
IO_TIMEOUT_S = 30.0  # a connection idle this long within one read or write is dropped
# Reads in flight at once from every decode worker together (each runs a few at a time,
# ``max_parallel_reads``), and connections not yet authorized among them: a reader is
# authorized within one round trip of connecting, so a few dozen is ample for honest readers.
MAX_CONNECTIONS = 256
MAX_UNAUTHENTICATED = 32


class RowSlice(NamedTuple):
    """Of each ``row_bytes`` row of a block, the ``length`` bytes at ``offset`` (a READ by head)."""

    row_bytes: int
    offset: int
    length: int

    def check(self, block_bytes: int, last_rows: int) -> None:
        """Raise ReadRefused unless it fits a block of ``block_bytes`` with ``last_rows`` rows read last."""
        if not (0 < self.row_bytes <= block_bytes and block_bytes % self.row_bytes == 0):
            raise ReadRefused(f"row_bytes {self.row_bytes} does not divide the holder's {block_bytes} bytes a block")
        if not (0 < self.length and self.offset + self.length <= self.row_bytes):
            raise ReadRefused(f"{self.length} bytes at offset {self.offset} are not within a row of {self.row_bytes}")
        if not 0 < last_rows <= block_bytes // self.row_bytes:
            raise ReadRefused(f"last block rows {last_rows} not in (0, {block_bytes // self.row_bytes}]")

    def nbytes(self, num_blocks: int, block_bytes: int, last_rows: int) -> int:
        return ((num_blocks - 1) * (block_bytes // self.row_bytes) + last_rows) * self.length


class ReadRefused(Exception):
    """A READ the holder will not serve; the reason names the field and the limit."""


class WireError(Exception):
    """The connection broke or carried a malformed frame."""


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; raises WireError if the peer closes first."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise WireError(f"peer closed the connection after {got} of {len(view)} bytes")
        got += n


def _advance(views: list[memoryview], first: int, nbytes: int) -> int:
    """Consume ``nbytes`` from ``views[first:]`` in place; return the first unfinished one."""
    while nbytes > 0:
        if nbytes >= len(views[first]):
            nbytes -= len(views[first])
            first += 1
        else:
            views[first] = views[first][nbytes:]
            nbytes = 0
    return first


def recv_exact_into_many(sock: socket.socket, views: list[memoryview]) -> None:
    """Fill every view in order, scatter-reading up to IOV_MAX of them per syscall (one GIL
    round trip per syscall instead of one per block). TLS has no scatter read: one at a time."""
    views = [v for v in views if len(v)]
    if isinstance(sock, ssl.SSLSocket):
        for view in views:
            recv_exact_into(sock, view)
        return
    first = 0
    while first < len(views):
        nbytes = sock.recvmsg_into(views[first:first + _IOV_MAX])[0]
        if nbytes == 0:
            raise WireError(f"peer closed the connection with {len(views) - first} of "
                            f"{len(views)} buffers unfilled")
        first = _advance(views, first, nbytes)


def send_all_many(sock: socket.socket, views: list[memoryview]) -> None:
    """Send every view in order, gather-writing up to IOV_MAX of them per syscall (TLS: one
    at a time)."""
    views = [v for v in views if len(v)]
    if isinstance(sock, ssl.SSLSocket):
        for view in views:
            sock.sendall(view)
        return
    first = 0
    while first < len(views):
        first = _advance(views, first, sock.sendmsg(views[first:first + _IOV_MAX]))


def recv_exact(sock: socket.socket, nbytes: int) -> bytes:
    """Read exactly ``nbytes`` from ``sock``."""
    buf = bytearray(nbytes)
    recv_exact_into(sock, memoryview(buf))
    return bytes(buf)


def encode_read(block_ids: Sequence[int], notify: bytes, last_block_bytes: int,
                row_slice: Optional[RowSlice] = None) -> bytes:
    """The READ frame for ``block_ids`` (the last one cut to ``last_block_bytes``) with
    ``notify`` for the holder; with ``row_slice``, a READ by head whose last block moves its
    first ``last_block_bytes`` rows."""
    if row_slice is None:
        head = READ_HEADER.pack(READ_MAGIC, len(block_ids), len(notify), last_block_bytes)
    else:
        head = READ_HEADER.pack(SLICE_MAGIC, len(block_ids), len(notify), last_block_bytes) + ROW_SLICE.pack(*row_slice)
    return head + notify + struct.pack(f"!{len(block_ids)}I", *block_ids)


def decode_read(sock: socket.socket, max_blocks: int, block_bytes: int, lease_claimed: Callable[[bytes], bool]
                ) -> tuple[list[int], bytes, int, Optional[RowSlice]]:
    """Read one READ frame; returns (block ids, notify, last block bytes, None), or for a READ
    by head (block ids, notify, last block rows, its row slice). Raises ``ReadRefused`` before
    any buffer is sized by the sender: ``n_blocks`` over ``max_blocks`` (the holder's cache),
    ``last`` outside (0, ``block_bytes``] (by head: a slice that does not fit a block), a
    notify over ``MAX_NOTIFY_BYTES`` or one no claimed lease matches (``lease_claimed``)."""
    magic, n_blocks, notify_len, last = READ_HEADER.unpack(recv_exact(sock, READ_HEADER.size))
    if magic not in (READ_MAGIC, SLICE_MAGIC):
        raise WireError(f"bad READ magic {magic!r}, expected {READ_MAGIC!r} or {SLICE_MAGIC!r}")
    row_slice = RowSlice(*ROW_SLICE.unpack(recv_exact(sock, ROW_SLICE.size))) if magic == SLICE_MAGIC else None
    if notify_len > MAX_NOTIFY_BYTES:
        raise ReadRefused(f"notify_len {notify_len} is over the limit MAX_NOTIFY_BYTES={MAX_NOTIFY_BYTES}")
    if not 0 < n_blocks <= max_blocks:
        raise ReadRefused(f"n_blocks {n_blocks} is not in (0, {max_blocks}], the holder's num_blocks")
    if row_slice is not None:
        row_slice.check(block_bytes, last)
    elif not 0 < last <= block_bytes:
        raise ReadRefused(f"last block bytes {last} not in (0, {block_bytes}]")
    notify = recv_exact(sock, notify_len)
    if not lease_claimed(notify):
        raise ReadRefused("no claimed lease matches this read's token")
    ids = list(struct.unpack(f"!{n_blocks}I", recv_exact(sock, 4 * n_blocks)))
    return ids, notify, last, row_slice


def recv_reply_header(sock: socket.socket, expected_bytes: int) -> None:
    """Read the REPLY header; raises WireError with the holder's reason unless it is OK."""
    status, length = REPLY_HEADER.unpack(recv_exact(sock, REPLY_HEADER.size))
    if status != STATUS_OK:
        reason = recv_exact(sock, min(length, 4096)).decode("utf-8", "replace")
        raise WireError(f"holder refused the read: {reason}")
    if length != expected_bytes:
        raise WireError(f"holder sends {length} bytes, expected {expected_bytes}")


class _Server(socketserver.ThreadingTCPServer):
    """A threading TCP server that asks ``admission`` before it starts a thread."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler, admission: Admission):
        self.admission = admission
        super().__init__(address, handler)

    def process_request(self, request, client_address) -> None:
        if not self.admission.admit():
            self.shutdown_request(request)  # closed at once: no thread, no byte read
            return
        super().process_request(request, client_address)


class BlockServer:
    """Serves reads of ``blocks`` (a (num_blocks, block_bytes) uint8 view of the cache) and
    hands each acknowledged read's notify to ``on_notify``. Runs on background threads. With
    ``ssl_context`` (a server context that requires client certificates) every reader must
    complete a TLS handshake first. At most ``max_connections`` connections at once, of which
    ``max_unauthenticated`` not yet authorized (the module docstring says why)."""

    def __init__(self, host: str, port: int, blocks: torch.Tensor,
                 on_notify: Callable[[bytes], None],
                 authorize: Callable[[bytes, list[int]], bool] = lambda notify, ids: True,
                 ssl_context: ssl.SSLContext | None = None, reader_roles: frozenset[str] = frozenset(),
                 io_timeout_s: float = IO_TIMEOUT_S,
                 max_connections: int = MAX_CONNECTIONS, max_unauthenticated: int = MAX_UNAUTHENTICATED):
        if not 1 <= max_unauthenticated <= max_connections:
            raise ValueError(f"max_unauthenticated must be in [1, max_connections={max_connections}], "
                             f"got {max_unauthenticated}")
        self._blocks = blocks
        self._io_timeout_s = io_timeout_s
        self._ssl = ssl_context
        self._reader_roles = reader_roles  # with ssl_context: a reader's certificate names one of them
        self._authorize = authorize  # whether the read's notify (a lease token) covers its blocks
        # CPU caches are sent straight from their storage; CUDA blocks are gathered to host.
        self._host = blocks.numpy() if blocks.device.type == "cpu" else None
        self._on_notify = on_notify
        self.admission = Admission(max_connections, max_unauthenticated)
        # Test-only fault injection (tests/conformance): while True, an authorized read is
        # accepted and never answered, as a holder whose sending stalled would leave it.
        self.inject_stall = False
        server = self

        class _Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                ticket = Ticket(server.admission)  # admitted by _Server.process_request
                try:
                    server._accept(self.request, ticket)
                finally:
                    ticket.close()

        self._server = _Server((host, port), _Handler, self.admission)
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,),
                                        name=f"kv-tcp-server-{port}", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        """``host:port`` the server listens on (the real port when 0 was asked for)."""
        host, port = self._server.server_address[:2]
        return f"{host}:{port}"

    def _accept(self, sock: socket.socket, ticket: Ticket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(self._io_timeout_s)
        if self._ssl is None:
            self._serve(sock, ticket)
            return
        sock.settimeout(min(HANDSHAKE_TIMEOUT_S, self._io_timeout_s))
        try:
            tls_sock = self._ssl.wrap_socket(sock, server_side=True)
        except OSError as exc:  # ssl.SSLError too: no certificate, another CA's, or not TLS at all
            logger.info("tcp kv read refused: TLS handshake failed: %s", exc)
            return
        with tls_sock:
            if not self._reader_roles & peer_roles(tls_sock):  # a cluster certificate, but not a reader of ours
                logger.info("tcp kv read refused: the reader's certificate names none of the roles that read "
                            "this worker's KV (%s)", ", ".join(sorted(self._reader_roles)) or "none")
                return
            tls_sock.settimeout(self._io_timeout_s)
            self._serve(tls_sock, ticket)

    def _serve(self, sock: socket.socket, ticket: Ticket) -> None:
        num_blocks, block_bytes = self._blocks.shape
        try:
            try:
                ids, notify, last, row_slice = decode_read(sock, num_blocks, block_bytes,
                                                           lambda n: self._authorize(n, []))
                ticket.authenticated()  # its token is a claimed lease's
                bad = [i for i in ids if i >= num_blocks]
                if bad:
                    raise ReadRefused(f"block ids out of range [0, {num_blocks}): {bad[:8]}")
                if not self._authorize(notify, ids):
                    raise ReadRefused("no claimed lease covers these blocks")
            except ReadRefused as exc:
                reason = str(exc).encode()
                sock.sendall(REPLY_HEADER.pack(STATUS_ERROR, len(reason)) + reason)
                return
            if self.inject_stall:
                self._stall(sock)
                return
            length = (len(ids) - 1) * block_bytes + last if row_slice is None else \
                row_slice.nbytes(len(ids), block_bytes, last)
            sock.sendall(REPLY_HEADER.pack(STATUS_OK, length))
            if row_slice is None:
                self._send_blocks(sock, ids, last)
            else:
                self._send_rows(sock, ids, last, row_slice)
            if recv_exact(sock, len(ACK_MAGIC)) != ACK_MAGIC:
                raise WireError("bad ACK magic")
            if notify:
                self._on_notify(notify)
            sock.sendall(STATUS.pack(STATUS_OK))
        except (OSError, WireError, struct.error) as exc:
            # The reader sees the broken connection and fails its read; nothing to undo here.
            logger.info("tcp kv read broke off: %s", exc)

    @staticmethod
    def _stall(sock: socket.socket) -> None:
        """``inject_stall``: send nothing, and hold the connection until the reader closes it."""
        while True:
            try:
                if not sock.recv(1):
                    return
            except socket.timeout:
                continue

    def _send_blocks(self, sock: socket.socket, ids: list[int], last: int) -> None:
        if self._host is not None:
            views = [memoryview(self._host[i]) for i in ids]
            views[-1] = views[-1][:last]
            send_all_many(sock, views)
            return
        index = torch.tensor(ids, device=self._blocks.device)
        flat = self._blocks.index_select(0, index).cpu().numpy().reshape(-1)
        sock.sendall(memoryview(flat[: flat.size - (self._blocks.shape[1] - last)]))

    def _send_rows(self, sock: socket.socket, ids: list[int], last_rows: int, row_slice: RowSlice) -> None:
        """A READ by head: of each block's rows (the last block's first ``last_rows``), the
        slice's bytes, gathered block by block (numpy) and sent."""
        host = self._host if self._host is not None else \
            self._blocks.index_select(0, torch.tensor(ids, device=self._blocks.device)).cpu().numpy()
        index = ids if self._host is not None else range(len(ids))
        lo, hi = row_slice.offset, row_slice.offset + row_slice.length
        parts = [host[i].reshape(-1, row_slice.row_bytes)[:, lo:hi] for i in index]
        parts[-1] = parts[-1][:last_rows]
        send_all_many(sock, [memoryview(np.ascontiguousarray(p)).cast("B") for p in parts])

    def close(self) -> None:
        """Stop accepting reads and close the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
