"""A tensor-parallel rank's KV-transfer agent, created in that rank's process and driven from
rank 0's: ``serve`` runs in the rank (over its own cache: its part of the shared file on the
CPU, its VRAM on CUDA), ``RemoteAgent`` is the agent as rank 0 holds it.

Rank 0 alone schedules, speaks gRPC and moves KV (``pdserve.kv_transfer.rank_agents``), but
each rank's cache is registered by the process that owns its memory. So rank 0 sends each call
a ``RankAgents`` makes of rank r's agent (metadata, checksums, read notices, peers, reads and
their polls) over the socket pair it shares with rank r (``pdserve.engine.distributed.group``),
as one ``RankAgentCall`` (pdserve/protos/rank_agent.proto), and waits for its reply; one call
at a time a rank. A read is followed by its id: ``RemoteAgent`` keeps a ``TransferHandle`` of
its own per read, brought up to date by each poll, and records the read in its ``stats`` (the
worker's, shared by every rank) once it ends.

A holder that serves reads itself (tcp) asks whether a read is covered by a claimed lease:
the lease table is rank 0's, so the rank asks rank 0 over a second socket pair, which rank 0
sends along when it sets the guard (``GuardQuery``, ``GuardAnswer``).

A rank that is gone (its socket closed) fails every call with a ``TransferError``, and every
read of it not over; the worker's loss of the rank is ``RankGroup``'s to act on.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from pdserve.kv_transfer.errors import InvalidTransferRequest, TransferError
from pdserve.kv_transfer.rank_wire import raise_error, receive, send
from pdserve.kv_transfer.rank_server import RankAgentServer
from pdserve.kv_transfer.read import TransferHandle, TransferState, TransferStats
from pdserve.kv_transfer.sharding import KVShard
from pdserve.protos import kv_transfer_pb2, rank_agent_pb2 as pb

__all__ = ["RemoteAgent", "serve"]

log = logging.getLogger(__name__)

# create_agent's options a rank's agent takes (the rest are refused by name).
OPTIONS = ("inject_delay_s", "read_timeout_s", "host", "advertise_host", "net_devices", "tls")


# ---- rank 0's side ----------------------------------------------------------------------
class RemoteAgent:
    """Rank r's agent as rank 0 holds it: what ``RankAgents`` and ``KVSource`` call of an
    agent, each a call to rank r's process (module docstring)."""

    def __init__(self, sock: socket.socket, name: str, shard: Optional[KVShard], guards_reads: bool):
        self.name, self.shard, self.guards_reads = name, shard, guards_reads
        self.stats = TransferStats()
        self._sock, self._lock = sock, threading.Lock()
        self._handles: dict[int, TransferHandle] = {}
        self._landing: dict[int, TransferHandle] = {}  # terminal, not yet over on the rank (read_over)
        self._guard: Optional[Callable[[str, list[int]], bool]] = None
        self._guard_sock: Optional[socket.socket] = None
        self._expecting: Optional[tuple[bool, bool]] = None  # the last expect_reads the rank heard

    @classmethod
    def create(cls, sock: socket.socket, backend: str, name: str, shard: Optional[KVShard],
               **opts: Any) -> RemoteAgent:
        """Have the rank at the other end of ``sock`` create its agent over its own cache, as
        ``create_agent(backend, name, cache, shard=shard, **opts)`` would. Raises what
        ``create_agent`` raises there (BackendUnavailable, InvalidTransferRequest)."""
        unknown = sorted(set(opts) - set(OPTIONS))
        if unknown:
            raise InvalidTransferRequest(f"a tensor-parallel rank's agent takes {', '.join(OPTIONS)}; not "
                                         f"{', '.join(unknown)}", field=unknown[0])
        call = pb.CreateRankAgent(backend=backend, name=name, host=opts.get("host") or "",
                                  advertise_host=opts.get("advertise_host") or "",
                                  net_devices=opts.get("net_devices") or "",
                                  inject_delay_s=opts.get("inject_delay_s", 0.0),
                                  read_timeout_s=opts.get("read_timeout_s", 30.0))
        if shard is not None:
            call.shard.CopyFrom(shard.to_proto())
        tls = opts.get("tls")
        if tls is not None:
            call.has_tls, call.tls_cert_pem, call.tls_key_pem = True, tls.cert_pem, tls.key_pem
            call.has_tls_ca, call.tls_ca_pem = tls.ca_pem is not None, tls.ca_pem or b""
        agent = cls(sock, name, shard, guards_reads=_guards_reads(backend))
        agent._call(pb.RankAgentCall(create=call))
        return agent

    def _call(self, call: pb.RankAgentCall, fds: Sequence[int] = ()) -> pb.RankAgentReply:
        with self._lock:
            try:
                send(self._sock, call, fds)
                reply = receive(self._sock, pb.RankAgentReply)
            except OSError as exc:
                raise TransferError(f"tensor-parallel rank agent {self.name!r} is gone ({exc})", peer=self.name) from exc
        if reply is None:
            raise TransferError(f"tensor-parallel rank agent {self.name!r} is gone (its process closed the channel)",
                                peer=self.name)
        if reply.WhichOneof("reply") == "error":
            raise_error(reply.error, self.name)
        return reply

    # ---- holder side ------------------------------------------------------------------
    def local_metadata(self) -> kv_transfer_pb2.AgentMetadata:
        return self._call(pb.RankAgentCall(metadata=pb.NoArgs())).metadata

    def block_checksums(self, block_ids: Sequence[int], last_block_bytes: Optional[int] = None) -> tuple[int, ...]:
        call = pb.ChecksumsCall(block_ids=list(block_ids), last_block_bytes=last_block_bytes or 0)
        return tuple(self._call(pb.RankAgentCall(checksums=call)).checksums.values)

    @property
    def checksums_per_block(self) -> int:
        return 1 if self.shard is None else self.shard.checksum_groups

    def get_notifications(self) -> list[bytes]:
        return list(self._call(pb.RankAgentCall(notifications=pb.NoArgs())).notifications.notes)

    def expect_reads(self, expected: bool, urgent: bool = True) -> None:
        """As the agent's; a worker says it at every step, so only a change crosses to the rank."""
        if self._expecting == (expected, urgent):
            return
        self._call(pb.RankAgentCall(expect_reads=pb.ExpectReadsCall(expected=expected, urgent=urgent)))
        self._expecting = (expected, urgent)

    @property
    def read_guard(self) -> Optional[Callable[[str, list[int]], bool]]:
        return self._guard

    @read_guard.setter
    def read_guard(self, guard: Optional[Callable[[str, list[int]], bool]]) -> None:
        """Answer the rank's guard queries with ``guard`` on a thread here (None: serve every read)."""
        if self._guard_sock is not None:
            self._guard_sock.close()  # its thread ends
            self._guard_sock = None
        self._guard = guard
        if guard is None:
            self._call(pb.RankAgentCall(guard=pb.GuardCall(on=False)))
            return
        ours, theirs = socket.socketpair()
        try:
            self._call(pb.RankAgentCall(guard=pb.GuardCall(on=True)), fds=[theirs.fileno()])
        finally:
            theirs.close()
        self._guard_sock = ours
        threading.Thread(target=_answer_guard, args=(ours, guard), name=f"{self.name}-guard", daemon=True).start()

    # ---- reader side ------------------------------------------------------------------
    def add_remote(self, meta: kv_transfer_pb2.AgentMetadata) -> str:
        return self._call(pb.RankAgentCall(add_remote=meta)).peer

    def start_read(self, peer: str, remote_block_ids: Sequence[int], local_block_ids: Sequence[int],
                   notify: bytes = b"", last_block_bytes: Optional[int] = None,
                   checksums: Optional[Sequence[int]] = None) -> TransferHandle:
        call = pb.StartReadCall(peer=peer, remote_block_ids=list(remote_block_ids),
                                local_block_ids=list(local_block_ids), notify=notify,
                                last_block_bytes=last_block_bytes or 0, has_checksums=checksums is not None,
                                checksums=list(checksums or ()))
        state = self._call(pb.RankAgentCall(start_read=call)).read
        handle = TransferHandle(transfer_id=state.transfer_id, peer=peer, remote_block_ids=tuple(remote_block_ids),
                                local_block_ids=tuple(local_block_ids), notify=notify,
                                last_block_bytes=last_block_bytes or 0, nbytes=state.nbytes,
                                started_at=state.started_at, post_at=state.started_at,
                                checksums=None if checksums is None else tuple(checksums))
        self._handles[handle.transfer_id] = handle
        self._update(handle, state)
        return handle

    def poll(self, handle: TransferHandle) -> TransferState:
        if handle.state.is_terminal:
            return handle.state
        try:
            state = self._call(pb.RankAgentCall(poll=pb.ReadCall(transfer_id=handle.transfer_id))).read
        except TransferError as exc:
            self._end(handle, TransferState.FAILED, str(exc))
            return handle.state
        self._update(handle, state)
        return handle.state

    def cancel(self, handle: TransferHandle) -> TransferState:
        if handle.state.is_terminal:
            return handle.state
        try:
            state = self._call(pb.RankAgentCall(cancel=pb.ReadCall(transfer_id=handle.transfer_id))).read
        except TransferError:
            self._end(handle, TransferState.CANCELLED, None)
            return handle.state
        self._update(handle, state)
        return handle.state

    def read_over(self, handle: TransferHandle) -> bool:
        """Whether no byte of the read can land in the rank's blocks any more: a poll of a read
        stopped in flight drives it on the rank (``KVTransferAgent.read_over``). A rank that is
        gone writes nothing."""
        if not handle.state.is_terminal:
            return False
        if handle.transfer_id in self._landing:
            try:
                self._update(handle, self._call(pb.RankAgentCall(poll=pb.ReadCall(transfer_id=handle.transfer_id))).read)
            except TransferError:
                self._landing.pop(handle.transfer_id, None)
        return handle.transfer_id not in self._landing

    def landing(self) -> int:
        return len(self._landing)

    def _update(self, handle: TransferHandle, state: pb.ReadState) -> None:
        handle.verify_failed = state.verify_failed
        if state.finished:
            handle.finished_at = state.finished_at
        self._end(handle, TransferState(state.state), state.error or None)
        if state.over or not handle.state.is_terminal:
            self._landing.pop(handle.transfer_id, None)
        else:
            self._landing[handle.transfer_id] = handle

    def _end(self, handle: TransferHandle, state: TransferState, error: Optional[str]) -> None:
        handle.state, handle.error = state, error or handle.error
        if state.is_terminal and self._handles.pop(handle.transfer_id, None) is not None:
            if handle.finished_at is None:
                handle.finished_at = time.monotonic()
            self.stats.record(state, handle.nbytes, handle.finished_at - handle.started_at, handle.verify_failed)

    def close(self) -> None:
        try:
            self._call(pb.RankAgentCall(close=pb.NoArgs()))
        except TransferError:
            pass  # the rank is gone: so is its agent
        if self._guard_sock is not None:
            self._guard_sock.close()


def _guards_reads(backend: str) -> bool:
    """Whether ``backend``'s holder serves reads itself (``KVTransferAgent.guards_reads``)."""
    if backend == "tcp":
        from pdserve.kv_transfer.tcp_backend import TcpAgent
        return TcpAgent.guards_reads
    return False


def _answer_guard(sock: socket.socket, guard: Callable[[str, list[int]], bool]) -> None:
    """Rank 0: answer a rank's guard queries until the socket closes."""
    try:
        while (query := receive(sock, pb.GuardQuery)) is not None:
            send(sock, pb.GuardAnswer(allowed=guard(query.note.decode(errors="replace"), list(query.block_ids))))
    except OSError:
        pass  # closed: the guard was replaced, or the rank is gone


# ---- the rank's side --------------------------------------------------------------------
def serve(sock: socket.socket, cache: torch.Tensor) -> None:
    """In rank r's process: create its agent over ``cache`` when rank 0 asks, then answer rank
    0's calls until it closes the agent or the socket."""
    RankAgentServer(sock, cache).run()
