"""Plain TCP backend, for hosts where UCX cannot run; chosen explicitly, never as a silent
fallback. Each agent serves reads of its cache from a small server thread; each read runs on
a background thread so ``start_read`` returns at once and ``poll`` works as with NIXL.
Received bytes go straight into the local blocks (via a host staging buffer for CUDA caches);
a read by head (``pdserve.kv_transfer.sharding``) receives its rows into a host buffer and
writes each into its place.
Framing is in ``pdserve.kv_transfer.tcp_wire``. With ``tls`` (the internal plane's mTLS config) the
server and every read speak TLS with client certificates, as the gRPC channels do, and each end
checks the other's role by the direction of the read (``kv_peer_roles``): a prefill worker's
blocks are read by decode workers, a decode worker's held prefix (the reversed pull) by prefill
workers.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch

from pdserve.kv_transfer import tcp_wire
from pdserve.kv_transfer.base import MAX_PEER_BLOCKS, KVTransferAgent
from pdserve.kv_transfer.errors import BackendUnavailable, InvalidTransferRequest
from pdserve.kv_transfer.layout import block_bytes_view
from pdserve.kv_transfer.read import TransferHandle, TransferState
from pdserve.kv_transfer.sharding import KVShard
from pdserve.kv_transfer.staged import put_in_place
from pdserve.protos import kv_transfer_pb2
from pdserve.wire.tls import TlsConfig, certificate_roles, peer_roles

logger = logging.getLogger(__name__)

_CANCEL_JOIN_S = 5.0  # a cancelled read stops within one recv; this only bounds a wedged one
# Who reads whose KV, keyed by the holder's role: a prefill worker's blocks go to a decode
# worker, a decode worker's held prefix (the reversed pull) to a prefill worker. Symmetric, so
# the same map gives a reader the role of the holders it reads.
KV_PEER = {"prefill": "decode", "decode": "prefill"}


def kv_peer_roles(roles: frozenset[str]) -> frozenset[str]:
    """The roles at the other end of the KV reads of a worker whose certificate names ``roles``:
    the readers it serves, which are also the holders it reads. An elastic worker names both
    roles, and so serves and reads both."""
    return frozenset(KV_PEER[role] for role in roles if role in KV_PEER)


class _TcpRead:
    """One read running on a worker thread; ``poll`` reads its outcome."""

    def __init__(self) -> None:
        self.finished = threading.Event()
        self.cancelled = threading.Event()
        self.error: Optional[str] = None
        self._cancelled = False
        self._sock: Optional[socket.socket] = None
        self._lock = threading.Lock()

    def attach(self, sock: socket.socket) -> bool:
        """Remember the socket so ``cancel`` can break it; False if already cancelled."""
        with self._lock:
            self._sock = sock
            return not self._cancelled

    def cancel(self) -> None:
        """Stop the read: break its connection and wait (once, bounded) for its thread to end;
        once ``finished`` is set no more bytes land in the local blocks."""
        self.cancelled.set()
        with self._lock:
            if self._cancelled:
                return
            self._cancelled = True
            connected = self._sock is not None
            if connected:
                try:  # the blocked recv returns at once (the plain shutdown, under TLS too)
                    socket.socket.shutdown(self._sock, socket.SHUT_RDWR)
                except OSError:
                    pass  # already closed by the worker
        if connected:
            # Blocks are written only after attach(); wait so a caller that frees them on
            # return cannot race a late write. Unconnected reads never write: no wait.
            self.finished.wait(_CANCEL_JOIN_S)


class TcpAgent(KVTransferAgent):
    """KV-transfer agent over plain TCP sockets.

    Extra options: ``host`` to bind (default 127.0.0.1), ``advertise_host`` for peers to dial
    (default: ``host``; a worker passes its internal plane's, see ``pdserve.wire.address``), ``port``
    (0 picks a free one), ``max_parallel_reads`` (reader threads), ``tls`` (mTLS: a
    ``TlsConfig`` with a CA; the server refuses readers without a certificate it signed, and
    reads check the holder's). Raises BackendUnavailable if the server cannot bind.
    """

    backend_name = "tcp"
    guards_reads = True

    def __init__(self, name: str, cache: torch.Tensor, *, inject_delay_s: float = 0.0,
                 read_timeout_s: float = 30.0, max_peer_blocks: int = MAX_PEER_BLOCKS, shard: KVShard | None = None,
                 host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None,
                 max_parallel_reads: int = 4, tls: TlsConfig | None = None):
        super().__init__(name, cache, inject_delay_s=inject_delay_s,
                         read_timeout_s=read_timeout_s, max_peer_blocks=max_peer_blocks, shard=shard)
        if max_parallel_reads < 1:
            raise InvalidTransferRequest(
                f"max_parallel_reads must be >= 1, got {max_parallel_reads}",
                field="max_parallel_reads", limit=1)
        self._blocks = block_bytes_view(cache)  # (num_blocks, block_bytes) uint8
        self._host_blocks = self._blocks.numpy() if cache.device.type == "cpu" else None
        self._notifications: list[bytes] = []
        self._notify_lock = threading.Lock()
        self._addresses: dict[str, tuple[str, int]] = {}
        if tls is not None and not tls.requires_client_cert:
            raise InvalidTransferRequest("tls needs a CA: the block server must refuse readers "
                                         "without a certificate of the cluster", field="tls")
        self._tls = tls
        # With mTLS: the roles of this worker's KV peers, readers and holders alike (kv_peer_roles).
        self._peer_roles = kv_peer_roles(certificate_roles(tls.cert_pem)) if tls else frozenset()
        self._client_ssl = tls.client_context() if tls else None
        if self._client_ssl is not None:  # the holder's role is checked after the handshake (_connect)
            self._client_ssl.check_hostname = False
        try:
            self._server = tcp_wire.BlockServer(host, port, self._blocks, self._on_notify,
                                                self._authorize, tls.server_context() if tls else None,
                                                reader_roles=self._peer_roles)
        except OSError as exc:
            raise BackendUnavailable("tcp", f"cannot listen on {host}:{port}: {exc}") from exc
        port = self._server.address.rpartition(":")[2]
        self._advertised = f"{advertise_host or host}:{port}"
        self._pool = ThreadPoolExecutor(max_workers=max_parallel_reads,
                                        thread_name_prefix=f"kv-tcp-read-{name}")
        # Test-only fault injection (tests/conformance): while True, a read sends its request
        # and then never receives, as a reader whose side of the transfer stalled; only its
        # cancel (``read_timeout_s``, an abort) ends it. Serving side: ``inject_holder_stall``.
        self.inject_reader_stall = False

    @property
    def inject_holder_stall(self) -> bool:
        """Test-only: while True this agent's block server accepts reads and never answers."""
        return self._server.inject_stall

    @inject_holder_stall.setter
    def inject_holder_stall(self, on: bool) -> None:
        self._server.inject_stall = on

    def _authorize(self, notify: bytes, block_ids: list[int]) -> bool:
        return self.read_guard is None or self.read_guard(notify.decode(errors="replace"), block_ids)

    def _on_notify(self, msg: bytes) -> None:
        with self._notify_lock:
            self._notifications.append(msg)

    def get_notifications(self) -> list[bytes]:
        """Notifications of reads acknowledged since the last call, in arrival order."""
        with self._notify_lock:
            out, self._notifications = self._notifications, []
        return out

    def _fill_backend_metadata(self, meta: kv_transfer_pb2.AgentMetadata) -> None:
        meta.tcp_address = self._advertised

    def _connect_peer(self, meta: kv_transfer_pb2.AgentMetadata) -> None:
        host, sep, port = meta.tcp_address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise InvalidTransferRequest(
                f"peer {meta.agent_name!r} has tcp_address {meta.tcp_address!r}, expected "
                "host:port", field="tcp_address", peer=meta.agent_name)
        self._addresses[meta.agent_name] = (host, int(port))

    def _drop_peer(self, name: str) -> None:
        self._addresses.pop(name, None)

    def _start_backend(self, handle: TransferHandle) -> TransferState:
        job = _TcpRead()
        handle.backend_handle = job
        self._pool.submit(self._run_read, job, self._addresses[handle.peer], handle)
        return TransferState.TRANSFERRING

    def _poll_backend(self, handle: TransferHandle) -> TransferState:
        job: _TcpRead = handle.backend_handle
        if not job.finished.is_set():
            return TransferState.TRANSFERRING
        if job.error is not None:
            handle.error = job.error
            return TransferState.FAILED
        return TransferState.DONE

    def _free_backend(self, handle: TransferHandle) -> bool:
        """Break the read's connection and wait (bounded) for its thread to end: bytes land only
        from that thread, so once it has, none can."""
        job: _TcpRead = handle.backend_handle
        if not job.finished.is_set():
            job.cancel()
        return job.finished.is_set()

    def _run_read(self, job: _TcpRead, address: tuple[str, int], handle: TransferHandle) -> None:
        remote, local, hs = handle.remote_block_ids, handle.local_block_ids, handle.slice
        try:
            with self._connect(address) as sock:
                if not job.attach(sock):
                    job.error = "cancelled before connecting"
                    return
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if hs is None or hs.whole_rows:  # whole blocks (by head: whole rows, so the same bytes)
                    last = handle.last_block_bytes if hs is None else handle.last_rows * hs.dst_row
                    sock.sendall(tcp_wire.encode_read(remote, handle.notify, last))
                    if self.inject_reader_stall:
                        job.cancelled.wait()
                        raise tcp_wire.WireError("the read stalled (inject_reader_stall) until it was cancelled")
                    tcp_wire.recv_reply_header(sock, (len(remote) - 1) * self.layout.block_bytes + last)
                    self._receive_blocks(sock, local, last)
                else:
                    row_slice = tcp_wire.RowSlice(hs.src_row, hs.src_offset, hs.length)
                    sock.sendall(tcp_wire.encode_read(remote, handle.notify, handle.last_rows, row_slice))
                    tcp_wire.recv_reply_header(sock, handle.nbytes)
                    self._receive_rows(sock, handle)
                sock.sendall(tcp_wire.ACK_MAGIC)
                tcp_wire.recv_exact(sock, tcp_wire.STATUS.size)
        except Exception as exc:  # every failure ends this read as FAILED with the reason
            job.error = f"tcp read from {address[0]}:{address[1]} failed: " \
                        f"{type(exc).__name__}: {exc}"
        finally:
            job.finished.set()

    def _connect(self, address: tuple[str, int]) -> socket.socket:
        """A connection to a holder; with mTLS, after a handshake that checks its certificate
        chains to the cluster's CA and names a role whose KV this worker reads: a decode
        worker reads prefill holders, a prefill worker decode holders."""
        sock = socket.create_connection(address, timeout=self.read_timeout_s)
        if self._client_ssl is None:
            return sock
        try:
            tls_sock = self._client_ssl.wrap_socket(sock)  # owns the connection from here on
        except BaseException:
            sock.close()
            raise
        held = peer_roles(tls_sock)
        if not held & self._peer_roles:
            tls_sock.close()
            raise tcp_wire.WireError(f"the holder's certificate names {', '.join(sorted(held)) or 'no role'}, "
                                     f"none of the roles whose KV this worker reads "
                                     f"({', '.join(sorted(self._peer_roles)) or 'none'})")
        return tls_sock

    def _receive_blocks(self, sock: socket.socket, local: tuple[int, ...], last: int) -> None:
        if self._host_blocks is not None:
            views = [memoryview(self._host_blocks[block]) for block in local]
            views[-1] = views[-1][:last]
            tcp_wire.recv_exact_into_many(sock, views)
            return
        staging = torch.zeros((len(local), self.layout.block_bytes), dtype=torch.uint8,
                              pin_memory=True)
        flat = memoryview(staging.numpy()).cast("B")
        tcp_wire.recv_exact_into(sock, flat[: len(flat) - (self.layout.block_bytes - last)])
        index = torch.tensor(local, device=self._blocks.device)
        self._blocks.index_copy_(0, index, staging.to(self._blocks.device, non_blocking=True))
        torch.cuda.current_stream(self._blocks.device).synchronize()

    def _receive_rows(self, sock: socket.socket, handle: TransferHandle) -> None:
        """A read by head: the slice of each row arrives row after row, into a host buffer,
        and is put in place in each local block's rows (``staged.put_in_place``, as a NIXL read
        by head does, over staged blocks of just the slices)."""
        hs, n = handle.slice, len(handle.local_block_ids)
        staging = torch.empty((n, hs.block_rows * hs.length), dtype=torch.uint8)  # the last block's tail unused
        tcp_wire.recv_exact_into(sock, memoryview(staging.numpy()).cast("B")[:handle.nbytes])
        sent = dataclasses.replace(hs, src_row=hs.length, src_offset=0)  # each row's slice alone
        put_in_place(staging.to(self._blocks.device), self._blocks, handle.local_block_ids, sent, handle.last_rows)
        if self._blocks.is_cuda:
            torch.cuda.current_stream(self._blocks.device).synchronize()

    def _close_backend(self) -> None:
        self._server.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
