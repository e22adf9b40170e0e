"""Typed errors of the KV-transfer layer; each names what failed and, where one applies, the
limit that was crossed. Re-exported by ``kv_transfer``."""

from __future__ import annotations

from typing import Optional


class TransferError(Exception):
    """A KV transfer could not be set up or did not complete.

    Attributes say what failed: ``field`` (the argument or config key at fault), ``limit``
    (the bound it crossed), ``peer`` (remote agent name) and ``backend`` ("nixl" / "tcp").
    """

    def __init__(self, message: str, *, field: Optional[str] = None, limit: object = None,
                 peer: Optional[str] = None, backend: Optional[str] = None):
        super().__init__(message)
        self.field = field
        self.limit = limit
        self.peer = peer
        self.backend = backend


class InvalidTransferRequest(TransferError, ValueError):
    """The caller passed bad arguments (block ids, lengths, metadata); also a ValueError so
    servers can map it to INVALID_ARGUMENT."""


class UnverifiedTransfer(TransferError):
    """A reader that verifies was asked to read blocks the holder sent no checksums for (a
    holder with ``verify_kv_transfers`` off, or an older one). Raised before any read starts:
    such bytes are never read, so they can never be used, published or summed again."""


class BackendUnavailable(TransferError):
    """The requested backend cannot start on this host (e.g. NIXL or UCX failed to load).

    Never answered by silently switching backends: the operator picks the fallback.
    """

    def __init__(self, backend: str, reason: str):
        super().__init__(f"kv_transfer backend {backend!r} is unavailable: {reason}",
                         field="kv_transfer_backend", backend=backend)
        self.reason = reason
