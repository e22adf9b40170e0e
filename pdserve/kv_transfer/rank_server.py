"""A tensor-parallel rank's side of ``pdserve.kv_transfer.remote_agent``: in the rank's own
process, create its KV-transfer agent over its own cache when rank 0 asks (``CreateRankAgent``),
then answer rank 0's calls on it, one at a time, until rank 0 closes the agent or the socket.

The reads it starts are kept by id until rank 0 has seen them over (a poll or cancel that
answers a terminal state), so a read's handle lives here exactly as long as rank 0 follows it.

On CUDA its work on the device (checksums of blocks, a read's verification) runs on a stream
of its own: while the rank waits for rank 0's next step, its default stream waits on that
broadcast (NCCL), and rank 0 asks between steps; on the default stream the two would wait on
each other. Rank 0 asks about blocks only once the step that wrote them is over on every rank
(its collectives completed), so nothing on the default stream is left to order against. The
tcp backend's own threads copy on their default stream: on a CUDA follower a tcp read may
wait for the rank's next step (NIXL, the GPU backend, has no such copies).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from typing import Optional

import torch

from pdserve.kv_transfer.base import KVTransferAgent
from pdserve.kv_transfer.errors import InvalidTransferRequest
from pdserve.kv_transfer.rank_wire import error_reply, receive, send
from pdserve.kv_transfer.read import TransferHandle
from pdserve.kv_transfer.sharding import KVShard
from pdserve.protos import rank_agent_pb2 as pb

__all__ = ["RankAgentServer"]

log = logging.getLogger(__name__)


class RankAgentServer:
    """Rank 0's calls on this rank's agent, over ``sock`` (its end of the rank's socket pair)."""

    def __init__(self, sock: socket.socket, cache: torch.Tensor):
        self.sock, self.cache = sock, cache
        self.agent: Optional[KVTransferAgent] = None
        self._reads: dict[int, TransferHandle] = {}
        self._guard_sock: Optional[socket.socket] = None
        self._guard_lock = threading.Lock()

    def run(self) -> None:
        """Answer calls until the agent is closed or rank 0's end of the socket is."""
        side = torch.cuda.stream(torch.cuda.Stream(self.cache.device)) if self.cache.is_cuda \
            else contextlib.nullcontext()
        with side:
            self._serve()

    def _serve(self) -> None:
        try:
            while True:
                got = receive(self.sock, pb.RankAgentCall, with_fds=True)
                if got is None:
                    break
                call, fds = got
                kind = call.WhichOneof("call")
                try:
                    reply = self._answer(kind, getattr(call, kind), fds)
                except Exception as exc:  # the call's error is rank 0's to raise
                    reply = error_reply(exc)
                send(self.sock, reply)
                if kind == "close":
                    break
        except OSError as exc:
            log.debug("rank agent channel closed: %s", exc)
        finally:
            self._close()

    def _answer(self, kind: str, arg, fds: list[int]) -> pb.RankAgentReply:
        if kind == "create":
            return self._create(arg)
        if kind == "guard":
            return self._set_guard(arg.on, fds)
        if kind == "close":
            self._close()
            return pb.RankAgentReply(ok=pb.NoArgs())
        agent = self.agent
        if agent is None:
            raise InvalidTransferRequest(f"no agent on this rank yet to answer {kind!r}: create it first",
                                         field="create")
        if kind == "metadata":
            return pb.RankAgentReply(metadata=agent.local_metadata())
        if kind == "checksums":
            sums = agent.block_checksums(list(arg.block_ids), arg.last_block_bytes or None)
            return pb.RankAgentReply(checksums=pb.Checksums(values=sums, per_block=agent.checksums_per_block))
        if kind == "notifications":
            return pb.RankAgentReply(notifications=pb.Notifications(notes=agent.get_notifications()))
        if kind == "expect_reads":
            agent.expect_reads(arg.expected, arg.urgent)
            return pb.RankAgentReply(ok=pb.NoArgs())
        if kind == "add_remote":
            return pb.RankAgentReply(peer=agent.add_remote(arg))
        if kind == "start_read":
            handle = agent.start_read(arg.peer, list(arg.remote_block_ids), list(arg.local_block_ids),
                                      notify=arg.notify, last_block_bytes=arg.last_block_bytes or None,
                                      checksums=list(arg.checksums) if arg.has_checksums else None)
            self._reads[handle.transfer_id] = handle
            return self._state(handle)
        if kind in ("poll", "cancel"):
            handle = self._reads.get(arg.transfer_id)
            if handle is None:
                raise InvalidTransferRequest(f"no read {arg.transfer_id} on this rank", field="transfer_id")
            (agent.poll if kind == "poll" else agent.cancel)(handle)
            return self._state(handle)
        raise InvalidTransferRequest(f"unknown rank agent call {kind!r}", field="call")

    def _create(self, arg: pb.CreateRankAgent) -> pb.RankAgentReply:
        from pdserve.kv_transfer import create_agent

        if self.agent is not None:
            raise InvalidTransferRequest("this rank's agent exists already", field="create")
        opts: dict = dict(inject_delay_s=arg.inject_delay_s, read_timeout_s=arg.read_timeout_s)
        if arg.HasField("shard"):
            opts["shard"] = KVShard.from_proto(arg.shard)
        if arg.host:
            opts["host"] = arg.host
        if arg.advertise_host:
            opts["advertise_host"] = arg.advertise_host
        if arg.net_devices:
            opts["net_devices"] = arg.net_devices
        if arg.has_tls:
            from pdserve.wire.tls import TlsConfig

            opts["tls"] = TlsConfig(arg.tls_cert_pem, arg.tls_key_pem, arg.tls_ca_pem if arg.has_tls_ca else None)
        self.agent = create_agent(arg.backend, arg.name, self.cache, **opts)
        return pb.RankAgentReply(ok=pb.NoArgs())

    def _set_guard(self, on: bool, fds: list[int]) -> pb.RankAgentReply:
        """Ask rank 0 about each read over the socket that came with the call (``on``), or
        serve every read."""
        if self.agent is None:
            raise InvalidTransferRequest("no agent on this rank yet to guard: create it first", field="create")
        if self._guard_sock is not None:
            self._guard_sock.close()
            self._guard_sock = None
        if not on:
            self.agent.read_guard = None
            return pb.RankAgentReply(ok=pb.NoArgs())
        if len(fds) != 1:
            raise InvalidTransferRequest(f"a guard comes with one socket, got {len(fds)}", field="fds", limit=1)
        self._guard_sock = socket.socket(fileno=fds[0])
        self.agent.read_guard = self._ask_rank_0
        return pb.RankAgentReply(ok=pb.NoArgs())

    def _ask_rank_0(self, note: str, block_ids: list[int]) -> bool:
        """The agent's read guard: rank 0's lease table answers (no answer: refused)."""
        with self._guard_lock:
            sock = self._guard_sock
            if sock is None:
                return False
            try:
                send(sock, pb.GuardQuery(note=note.encode(), block_ids=block_ids))
                answer = receive(sock, pb.GuardAnswer)
            except OSError:
                return False
            return answer is not None and answer.allowed

    def _state(self, handle: TransferHandle) -> pb.RankAgentReply:
        over = self.agent.read_over(handle)  # False while not terminal, or still landing
        if over:
            self._reads.pop(handle.transfer_id, None)
        return pb.RankAgentReply(read=pb.ReadState(
            transfer_id=handle.transfer_id, state=int(handle.state), error=handle.error or "",
            verify_failed=handle.verify_failed, nbytes=handle.nbytes, started_at=handle.started_at,
            finished_at=handle.finished_at or 0.0, finished=handle.finished_at is not None,
            descriptors=handle.descriptors, over=over))

    def _close(self) -> None:
        if self.agent is not None:
            self.agent.close()
            self.agent = None
        if self._guard_sock is not None:
            self._guard_sock.close()
            self._guard_sock = None
