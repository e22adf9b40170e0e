"""Moving KV-cache blocks between two workers' caches (pull model).

``create_agent(backend, name, cache)`` builds the agent a worker keeps for its lifetime; see
``pdserve.kv_transfer.base`` for the contract and the state of a read, ``pdserve.kv_transfer.read`` for its
types. Backends: ``"nixl"`` (default, NIXL over UCX) and ``"tcp"`` (plain sockets, for hosts
where UCX cannot run). A backend that cannot start raises BackendUnavailable; nothing falls
back silently.
"""

from __future__ import annotations

from typing import Any

import torch

from pdserve.kv_transfer.base import KVTransferAgent
from pdserve.kv_transfer.errors import BackendUnavailable, InvalidTransferRequest, TransferError, UnverifiedTransfer
from pdserve.kv_transfer.read import TransferHandle, TransferState, TransferStats

DEFAULT_BACKEND = "nixl"
BACKENDS = ("nixl", "tcp")

__all__ = ["BACKENDS", "DEFAULT_BACKEND", "BackendUnavailable", "InvalidTransferRequest",
           "KVTransferAgent", "TransferError", "TransferHandle", "TransferState",
           "TransferStats", "UnverifiedTransfer", "create_agent"]


def create_agent(backend: str, name: str, cache: torch.Tensor, **opts: Any) -> KVTransferAgent:
    """Build the ``backend`` agent named ``name`` over ``cache`` (registered once, here).

    ``opts`` go to the backend: ``inject_delay_s``, ``read_timeout_s``, ``max_peer_blocks`` and ``shard`` (a
    tensor-parallel rank's ``KVShard``: its heads, so that peers of other sizes read it by head) for all; NIXL takes
    ``num_threads``; tcp takes ``host``, ``port``, ``max_parallel_reads``.
    Raises ValueError naming ``kv_transfer_backend`` for an unknown backend, and
    BackendUnavailable when the chosen backend cannot start.
    """
    # Backends import lazily so that choosing "tcp" never loads NIXL/UCX.
    if backend == "nixl":
        from pdserve.kv_transfer.nixl_backend import NixlAgent
        return NixlAgent(name, cache, **opts)
    if backend == "tcp":
        from pdserve.kv_transfer.tcp_backend import TcpAgent
        return TcpAgent(name, cache, **opts)
    raise ValueError(f"kv_transfer_backend must be one of {', '.join(BACKENDS)}; "
                     f"got {backend!r}")
