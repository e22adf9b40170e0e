"""NIXL (UCX) backend: one-sided READs of peer blocks straight into local blocks.

The whole cache is registered once; descriptor lists with one descriptor per block are
prepared once for the local cache and once per peer, so a read is just two index lists
(NIXL merges adjacent blocks itself). DRAM caches use NIXL's DRAM segment, CUDA caches the
VRAM segment with their device ordinal. NIXL delivers ``notify`` to the holder after the data
has landed; the holder needs no knowledge of the reader to receive it.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from kv_transfer.base import KVTransferAgent, TransferHandle, TransferState
from kv_transfer.errors import BackendUnavailable, TransferError
from kv_transfer.layout import layout_of_metadata
from protos import kv_transfer_pb2

logger = logging.getLogger(__name__)

_NIXL_STATES = {"DONE": TransferState.DONE, "PROC": TransferState.TRANSFERRING,
                "ERR": TransferState.FAILED}


def _import_nixl() -> Any:
    try:
        import nixl_cu12
    except Exception as exc:  # ImportError, or a missing shared library (OSError)
        raise BackendUnavailable("nixl", f"cannot import nixl_cu12: {exc}") from exc
    return nixl_cu12


class NixlAgent(KVTransferAgent):
    """KV-transfer agent over NIXL with the UCX backend.

    Extra option: ``num_threads`` (UCX worker threads; 0 = NIXL's default).
    Raises BackendUnavailable when nixl_cu12, the UCX plugin or the agent cannot start.
    """

    backend_name = "nixl"

    def __init__(self, name: str, cache: torch.Tensor, *, inject_delay_s: float = 0.0,
                 read_timeout_s: float = 30.0, num_threads: int = 0):
        super().__init__(name, cache, inject_delay_s=inject_delay_s,
                         read_timeout_s=read_timeout_s)
        nixl = _import_nixl()
        try:
            config = nixl.nixl_agent_config(backends=["UCX"], num_threads=num_threads)
            self._agent = nixl.nixl_agent(name, config)
        except Exception as exc:
            raise BackendUnavailable("nixl", f"creating NIXL agent {name!r} with UCX failed: "
                                             f"{type(exc).__name__}: {exc}") from exc
        if "UCX" not in self._agent.backends:
            # nixl_agent only logs a warning when a requested plugin is missing.
            raise BackendUnavailable("nixl", "UCX plugin did not load (available plugins: "
                                             f"{self._agent.get_plugin_list()})")
        self._remote_dlists: dict[str, Any] = {}
        try:
            self._registration = self._agent.register_memory(
                self._region(), self.layout.nixl_mem_type)
            self._local_dlist = self._agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", self.layout.block_table(), self.layout.nixl_mem_type)
        except Exception as exc:
            raise BackendUnavailable("nixl", f"registering the {self.layout.nixl_mem_type} "
                                             f"cache failed: {type(exc).__name__}: {exc}") from exc

    def _region(self) -> list[tuple[int, int, int, str]]:
        total = self.layout.block_bytes * self.layout.num_blocks
        return [(self.layout.base_address, total, self.layout.device_id, "")]

    def _fill_backend_metadata(self, meta: kv_transfer_pb2.AgentMetadata) -> None:
        meta.backend_metadata = self._agent.get_agent_metadata()

    def _connect_peer(self, meta: kv_transfer_pb2.AgentMetadata) -> None:
        name = meta.agent_name
        try:
            loaded = self._agent.add_remote_agent(meta.backend_metadata)
        except Exception as exc:
            raise TransferError(f"loading NIXL metadata of peer {name!r} failed: "
                                f"{type(exc).__name__}: {exc}", field="backend_metadata",
                                peer=name, backend=self.backend_name) from exc
        loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
        if loaded != name:
            self._agent.remove_remote_agent(loaded)
            raise TransferError(f"NIXL metadata names agent {loaded!r} but agent_name is "
                                f"{name!r}", field="agent_name", peer=name,
                                backend=self.backend_name)
        remote = layout_of_metadata(meta)
        try:
            self._remote_dlists[name] = self._agent.prep_xfer_dlist(
                name, remote.block_table(), remote.nixl_mem_type)
        except Exception as exc:
            self._agent.remove_remote_agent(name)
            raise TransferError(f"preparing descriptors of peer {name!r} failed: "
                                f"{type(exc).__name__}: {exc}", peer=name,
                                backend=self.backend_name) from exc

    def _drop_peer(self, name: str) -> None:
        dlist = self._remote_dlists.pop(name, None)
        try:
            if dlist is not None:
                dlist.release()
            # Also disconnects; NIXL invalidates prepped lists of a re-added agent anyway.
            self._agent.remove_remote_agent(name)
        except Exception:
            logger.warning("dropping NIXL peer %r failed", name, exc_info=True)

    def _start_backend(self, handle: TransferHandle) -> TransferState:
        xfer = self._agent.make_prepped_xfer(
            "READ", self._local_dlist, np.asarray(handle.local_block_ids, dtype=np.int32),
            self._remote_dlists[handle.peer],
            np.asarray(handle.remote_block_ids, dtype=np.int32), handle.notify)
        handle.backend_handle = xfer
        return _NIXL_STATES[self._agent.transfer(xfer)]

    def _poll_backend(self, handle: TransferHandle) -> TransferState:
        return _NIXL_STATES[self._agent.check_xfer_state(handle.backend_handle)]

    def _release_backend(self, handle: TransferHandle) -> None:
        try:
            # On a read still in flight NIXL cancels it. If that fails the handle stays
            # unreleased and its finalizer parks it on the agent's leak list for teardown.
            handle.backend_handle.release()
        except Exception:
            logger.warning("releasing NIXL transfer %d failed", handle.transfer_id,
                           exc_info=True)

    def get_notifications(self) -> list[bytes]:
        """Notifications received since the last call (NIXL groups them by sender)."""
        with self._lock:
            self._check_open()
            by_peer = self._agent.get_new_notifs()
        return [msg for msgs in by_peer.values() for msg in msgs]

    def _close_backend(self) -> None:
        try:
            self._local_dlist.release()
            self._agent.deregister_memory(self._registration)
        except Exception:
            logger.warning("releasing NIXL registration of %r failed", self.name,
                           exc_info=True)
        # The agent (and its UCX worker) is destroyed with the last reference.
        self._agent = None
