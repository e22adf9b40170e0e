"""The wire between rank 0 and a tensor-parallel rank's agent (``pdserve.kv_transfer.remote_agent``):
each message framed by its length over a local socket pair, file descriptors riding along where
a call hands one over, and the transfer layer's typed errors carried across and raised again
on rank 0's side with their field and limit."""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence
from typing import Any, Optional

from pdserve.kv_transfer.errors import BackendUnavailable, InvalidTransferRequest, TransferError
from pdserve.protos import rank_agent_pb2 as pb

MAX_MESSAGE = 64 << 20  # a reply's notes or sums never come near; past it the stream is broken
_LEN = struct.Struct("!I")


# ---- framing ----------------------------------------------------------------------------
def send(sock: socket.socket, msg, fds: Sequence[int] = ()) -> None:
    """One message, its length first; ``fds`` ride along with it (SCM_RIGHTS)."""
    data = msg.SerializeToString()
    frame = _LEN.pack(len(data)) + data
    if fds:
        socket.send_fds(sock, [frame], list(fds))
    else:
        sock.sendall(frame)


def receive(sock: socket.socket, cls, with_fds: bool = False):
    """The next message of type ``cls`` (and the fds that came with it, ``with_fds``); None
    once the other side has closed."""
    fds: list[int] = []
    if with_fds:
        head, fds, _, _ = socket.recv_fds(sock, _LEN.size, 4)
        if not head:
            return None
        head += _exactly(sock, _LEN.size - len(head)) or b""
    else:
        head = _exactly(sock, _LEN.size)
    if head is None or len(head) < _LEN.size:
        return None
    (size,) = _LEN.unpack(head)
    if size > MAX_MESSAGE:
        raise TransferError(f"a rank agent message of {size} bytes is past the limit", field="message",
                            limit=MAX_MESSAGE)
    body = _exactly(sock, size)
    if body is None:
        return None
    msg = cls.FromString(body)
    return (msg, fds) if with_fds else msg


def _exactly(sock: socket.socket, n: int) -> Optional[bytes]:
    chunks, left = [], n
    while left:
        chunk = sock.recv(left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


# ---- errors -----------------------------------------------------------------------------
def error_reply(exc: Exception) -> pb.RankAgentReply:
    kind = ("invalid" if isinstance(exc, InvalidTransferRequest) else
            "unavailable" if isinstance(exc, BackendUnavailable) else "error")
    err = pb.RankAgentError(kind=kind, message=str(exc))
    if isinstance(exc, TransferError):
        err.field, err.peer, err.backend = exc.field or "", exc.peer or "", exc.backend or ""
        if exc.limit is not None:
            err.limit, err.has_limit = str(exc.limit), True
    elif isinstance(exc, ValueError):  # create_agent's unknown backend, a bad option
        err.kind = "invalid"
    return pb.RankAgentReply(error=err)


def raise_error(err: pb.RankAgentError, rank_name: str) -> None:
    limit: Any = err.limit if err.has_limit else None
    if isinstance(limit, str) and limit.lstrip("-").isdigit():
        limit = int(limit)
    opts = dict(field=err.field or None, limit=limit, peer=err.peer or None, backend=err.backend or None)
    message = f"{rank_name}: {err.message}"
    if err.kind == "invalid":
        raise InvalidTransferRequest(message, **opts)
    if err.kind == "unavailable":
        raise BackendUnavailable(err.backend, f"{rank_name}: {err.message}")
    raise TransferError(message, **opts)
