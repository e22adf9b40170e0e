"""NIXL (UCX) backend: one-sided READs of peer blocks straight into local blocks.

The whole cache is registered once; descriptor lists with one descriptor per block are
prepared once for the local cache and once per peer, so a read is just two index lists
(NIXL merges adjacent blocks itself). A read with a partly filled last block names its
descriptors, one a run of adjacent blocks (``staged.coalesce``). A read by head from a peer of
another tensor-parallel size (``pdserve.kv_transfer.sharding``) reads the peer's blocks whole
into a staging buffer and puts each row's heads in place here (``staged.StagedRead``): named row
by row it would be a descriptor per row, and UCX pays per descriptor. DRAM caches use NIXL's DRAM
segment, CUDA caches the VRAM segment with their device ordinal. NIXL delivers ``notify`` to the
holder after the data has landed; the holder needs no knowledge of the reader to receive it.

Progress: NIXL's own UCX progress thread is turned off because nixl_cu12's Python API fixes
its poll delay at 0, so it busy-spins a core per agent (measured: 1 core-second per second
while idle, halving READ throughput on a 2-core host). Instead a small Python thread drives
UCX every ``progress_interval_s`` (connection wire-up and notifications on the holder side,
which otherwise only progress when the holder calls in); ``poll`` progresses reads directly.

Listeners: NIXL's own metadata listener stays off (metadata travels over the worker's gRPC,
on the internal plane). UCX's TCP transport listens on every network interface it may use,
so ``net_devices`` holds it to the internal plane's interface (UCX_NET_DEVICES for this
agent's UCX context). NIXL's own ``ucx_devices`` parameter cannot do it: it names devices as
``name:1`` (an InfiniBand port), which matches no TCP interface. A UCX_NET_DEVICES set by the
operator (an RDMA device list, say) is left as it is.

Which NIXL: the wheel built for torch's CUDA (``nixl_cu12`` or ``nixl_cu13``): each bundles
a UCX whose CUDA transports link that CUDA's runtime, which a torch of the other CUDA does
not bring. A CPU torch (DRAM caches only) takes ``nixl_cu12``, or ``nixl_cu13`` if that is
the one installed.

CUDA threads: UCX decides whether cuda_ipc reaches a peer's VRAM, and arms its CUDA events,
in the calling thread's current CUDA context; a thread with none gets cuda_ipc marked
unreachable (UCX before 1.20, vLLM #36475) or a crash. So every call into NIXL first makes
the cache's device current on its thread (``cuda_binder``): the caller's threads (gRPC,
the engine) and the progress thread alike.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from contextlib import contextmanager
from typing import Any, Callable

import numpy as np
import torch

from pdserve.kv_transfer.base import MAX_PEER_BLOCKS, KVTransferAgent
from pdserve.kv_transfer.errors import BackendUnavailable, InvalidTransferRequest, TransferError
from pdserve.kv_transfer.layout import layout_of_metadata
from pdserve.kv_transfer.read import TransferHandle, TransferState
from pdserve.kv_transfer.sharding import KVShard
from pdserve.kv_transfer.staged import STAGING_BYTES, StagedRead, StagingPool, coalesce
from pdserve.protos import kv_transfer_pb2

logger = logging.getLogger(__name__)

_NIXL_STATES = {"DONE": TransferState.DONE, "PROC": TransferState.TRANSFERRING,
                "ERR": TransferState.FAILED}


@contextmanager
def _ucx_env(settings: dict[str, str]):
    """Each UCX ``settings`` variable set while the agent's UCX context is made, unless the
    operator has set it; the process's environment is as before afterwards."""
    added = {k: v for k, v in settings.items() if v and k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def ucx_settings(device: torch.device, net_devices: str | None) -> dict[str, str]:
    """The UCX variables an agent over a cache on ``device`` sets (where the operator has not).

    ``UCX_NET_DEVICES`` holds UCX's TCP listener to the internal plane (module docstring).
    ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y`` for a CUDA cache: pdserve's transfers are READs, and
    UCX enables cuda_ipc GETs only where it detects NVLink (its ``auto``), so a GPU without
    NVLink peers read VRAM from VRAM through a staged cuda_copy path: 0.45 GB/s for 377 MB on
    the first H100 run (BENCHMARKS.md, GPU)."""
    settings = {"UCX_NET_DEVICES": net_devices or ""}
    if device.type == "cuda":
        settings["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] = "y"
    return settings


NIXL_MODULES = {"12": "nixl_cu12", "13": "nixl_cu13"}  # torch's CUDA major -> the wheel built for it


def nixl_modules_for(cuda_version: str | None) -> tuple[str, ...]:
    """The NIXL modules that fit a torch built for ``cuda_version`` (``torch.version.cuda``;
    None for a CPU build), in the order to try them."""
    if cuda_version is None:
        return ("nixl_cu12", "nixl_cu13")  # DRAM only: either UCX serves it
    name = NIXL_MODULES.get(cuda_version.split(".")[0])
    return (name,) if name else ()


def _import_nixl() -> Any:
    """The NIXL module for this torch's CUDA (``torch.version.cuda``). Raises
    BackendUnavailable naming every NIXL module, why each did not serve, and the CUDA
    version."""
    cuda = torch.version.cuda
    wanted = nixl_modules_for(cuda)
    why: dict[str, str] = {}
    for name in wanted:
        try:
            return importlib.import_module(name)
        except Exception as exc:  # ImportError, or a missing shared library (OSError)
            why[name] = f"{type(exc).__name__}: {exc}"
    for name in NIXL_MODULES.values():
        why.setdefault(name, f"not tried: built for another CUDA than {cuda}")
    fits = " or ".join(n.replace("_", "-") for n in wanted) or f"none exists for CUDA {cuda}"
    raise BackendUnavailable("nixl", f"no NIXL module loads for torch with CUDA {cuda or 'none (a CPU build)'} "
                                     f"({'; '.join(f'{n}: {w}' for n, w in why.items())}); "
                                     f"install {fits}, or use kv_transfer_backend tcp")


def _nothing() -> None:
    return None


def cuda_binder(device: torch.device) -> Callable[[], None]:
    """A function that makes ``device`` (a CUDA cache's) the calling thread's current
    device, with its primary context bound, the first time each thread calls it; for a host
    cache it does nothing. ``torch.cuda.set_device`` alone may skip the CUDA call when the
    index is already the thread's default (0), and binds no context then; a stream query is a
    runtime call, which binds the device's primary context to the thread without waiting."""
    if device.type != "cuda":
        return _nothing
    index = device.index if device.index is not None else torch.cuda.current_device()
    bound = threading.local()

    def bind() -> None:
        if getattr(bound, "done", False):
            return
        torch.cuda.set_device(index)
        torch.cuda.current_stream(index).query()
        bound.done = True

    return bind


class NixlAgent(KVTransferAgent):
    """KV-transfer agent over NIXL with the UCX backend.

    Extra options: ``progress_interval_s`` (period of the progress thread, bounding the
    holder's wire-up and notification latency), ``relaxed_progress_interval_s`` (its period
    while reads may come but none is waited on, ``expect_reads(True, urgent=False)``),
    ``num_threads`` (UCX worker threads;
    0 = NIXL's default), ``net_devices`` (the network interfaces UCX may listen and connect
    on, comma-separated; None: UCX's default, every interface), ``staging_bytes`` and
    ``staging_buffers`` (the staging buffers reads by head between sizes take, their size and
    how many at most: ``pdserve.kv_transfer.staged``). Raises BackendUnavailable
    when no NIXL module fits (``_import_nixl``), or the UCX plugin or the agent cannot start.
    """

    backend_name = "nixl"

    def __init__(self, name: str, cache: torch.Tensor, *, inject_delay_s: float = 0.0,
                 read_timeout_s: float = 30.0, max_peer_blocks: int = MAX_PEER_BLOCKS, shard: KVShard | None = None,
                 progress_interval_s: float = 0.001, relaxed_progress_interval_s: float = 0.1,
                 num_threads: int = 0, net_devices: str | None = None, staging_bytes: int = STAGING_BYTES,
                 staging_buffers: int = 2):
        super().__init__(name, cache, inject_delay_s=inject_delay_s,
                         read_timeout_s=read_timeout_s, max_peer_blocks=max_peer_blocks, shard=shard)
        for option, value in (("progress_interval_s", progress_interval_s),
                              ("relaxed_progress_interval_s", relaxed_progress_interval_s)):
            if value <= 0:
                raise InvalidTransferRequest(f"{option} must be > 0, got {value}", field=option, limit=0)
        for option, value in (("staging_bytes", staging_bytes), ("staging_buffers", staging_buffers)):
            if value < 1:
                raise InvalidTransferRequest(f"{option} must be >= 1, got {value}", field=option, limit=1)
        nixl = _import_nixl()
        self._bind_device = cuda_binder(cache.device)
        self._bind_device()
        try:
            config = nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"],
                                            num_threads=num_threads)
            with _ucx_env(ucx_settings(cache.device, net_devices)):  # UCX reads them as the backend starts
                self._agent = nixl.nixl_agent(name, config)
        except Exception as exc:
            raise BackendUnavailable("nixl", f"creating NIXL agent {name!r} with UCX failed: "
                                             f"{type(exc).__name__}: {exc}") from exc
        if "UCX" not in self._agent.backends:
            # nixl_agent only logs a warning when a requested plugin is missing.
            raise BackendUnavailable("nixl", "UCX plugin did not load (available plugins: "
                                             f"{self._agent.get_plugin_list()})")
        self._remote_dlists: dict[str, Any] = {}
        self._notifications: list[bytes] = []
        try:
            self._registration = self._agent.register_memory(
                self._region(), self.layout.nixl_mem_type)
            self._local_dlist = self._agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", self.layout.block_table(), self.layout.nixl_mem_type)
        except Exception as exc:
            raise BackendUnavailable("nixl", f"registering the {self.layout.nixl_mem_type} "
                                             f"cache failed: {type(exc).__name__}: {exc}") from exc
        self._staging = StagingPool(self._agent, self.layout, cache.device, staging_bytes, staging_buffers)
        self._progress_interval_s = progress_interval_s
        self._intervals = (relaxed_progress_interval_s, progress_interval_s)  # by urgent
        self._stop_progress = threading.Event()
        self._reads_expected = threading.Event()  # see expect_reads
        self._reads_expected.set()
        self._progress_thread = threading.Thread(
            target=self._progress_loop, name=f"kv-nixl-progress-{name}", daemon=True)
        self._progress_thread.start()

    def expect_reads(self, expected: bool, urgent: bool = True) -> None:
        """Run the progress thread only while a peer may read from this agent (a prefill
        worker holding KV): otherwise it sleeps without waking. On by default. A READ here
        completes only once the holder's UCX progresses, so reads nobody waits on urgently
        (``urgent`` False: streamed KV's early reads) get the relaxed period."""
        self._progress_interval_s = self._intervals[urgent]
        if expected:
            self._reads_expected.set()
        else:
            self._reads_expected.clear()

    def _progress_loop(self) -> None:
        self._bind_device()
        while True:
            self._reads_expected.wait()
            if self._stop_progress.wait(self._progress_interval_s):
                return
            with self._lock:
                if self._agent is None:
                    return
                self._collect_notifications()

    def _collect_notifications(self) -> None:
        # Without NIXL's thread, getNotifs also runs the UCX progress loop.
        self._bind_device()
        for msgs in self._agent.get_new_notifs().values():
            self._notifications.extend(msgs)

    def _region(self) -> list[tuple[int, int, int, str]]:
        total = self.layout.block_bytes * self.layout.num_blocks
        return [(self.layout.base_address, total, self.layout.device_id, "")]

    def _fill_backend_metadata(self, meta: kv_transfer_pb2.AgentMetadata) -> None:
        self._bind_device()
        meta.backend_metadata = self._agent.get_agent_metadata()

    def _connect_peer(self, meta: kv_transfer_pb2.AgentMetadata) -> None:
        name = meta.agent_name
        self._bind_device()  # UCX unpacks the peer's keys here, and decides on cuda_ipc
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
        self._bind_device()
        try:
            if dlist is not None:
                dlist.release()
            # Also disconnects; NIXL invalidates prepped lists of a re-added agent anyway.
            self._agent.remove_remote_agent(name)
        except Exception:
            logger.warning("dropping NIXL peer %r failed", name, exc_info=True)

    def _start_backend(self, handle: TransferHandle) -> TransferState:
        self._bind_device()
        if handle.slice is not None and not handle.slice.whole_rows:
            # A read by head between sizes: whole blocks into staging, heads put in place (staged).
            staged = StagedRead(self._agent, handle, layout_of_metadata(self._peers[handle.peer]), self._staging,
                                self._block_rows)
            handle.backend_handle = staged
            return _NIXL_STATES[staged.post()]
        if handle.last_block_bytes == self.layout.block_bytes:  # whole blocks (or whole rows) a side
            xfer = self._agent.make_prepped_xfer(
                "READ", self._local_dlist, np.asarray(handle.local_block_ids, dtype=np.int32),
                self._remote_dlists[handle.peer],
                np.asarray(handle.remote_block_ids, dtype=np.int32), handle.notify)
        else:
            # A partly filled last block, or whole rows between equal sizes summed in other
            # groups: the prepared lists hold whole blocks only, so this read names its
            # descriptors (one a run of adjacent blocks, the last one shorter).
            remote, last = layout_of_metadata(self._peers[handle.peer]), handle.last_block_bytes
            local_descs, remote_descs = coalesce(self.layout.block_descs(handle.local_block_ids, last),
                                                 remote.block_descs(handle.remote_block_ids, last))
            handle.posted_descriptors = len(local_descs)
            xfer = self._agent.initialize_xfer(
                "READ", self._agent.get_xfer_descs(local_descs, self.layout.nixl_mem_type),
                self._agent.get_xfer_descs(remote_descs, remote.nixl_mem_type), handle.peer, handle.notify)
        handle.backend_handle = xfer
        return _NIXL_STATES[self._agent.transfer(xfer)]

    def _poll_backend(self, handle: TransferHandle) -> TransferState:
        self._bind_device()
        if isinstance(handle.backend_handle, StagedRead):
            return _NIXL_STATES[handle.backend_handle.poll()]
        return _NIXL_STATES[self._agent.check_xfer_state(handle.backend_handle)]

    def _free_backend(self, handle: TransferHandle) -> bool:
        """Release the read once NIXL says it is no longer in progress. Never before: NIXL's
        ``release`` of a READ in flight returns at once, but UCX goes on writing the local blocks
        (measured over UCX's tcp transport: 980 of 2048 blocks landed after it) and may then
        crash the process. So a stopped read keeps running to its end (its holder must still
        progress, or it never ends: its blocks stay quarantined)."""
        self._bind_device()
        if isinstance(handle.backend_handle, StagedRead):
            return handle.backend_handle.end()
        ended = handle.state is TransferState.DONE  # NIXL said so; else ask (which progresses UCX)
        if not ended and self._agent.check_xfer_state(handle.backend_handle) == "PROC":
            return False
        try:
            handle.backend_handle.release()
        except Exception:  # its finalizer parks it on the agent's leak list for teardown
            logger.warning("releasing NIXL transfer %d failed", handle.transfer_id, exc_info=True)
        return True

    def get_notifications(self) -> list[bytes]:
        """Notifications received since the last call, in arrival order per sender."""
        with self._lock:
            self._check_open()
            self._collect_notifications()
            out, self._notifications = self._notifications, []
        return out

    def close(self) -> None:
        """Stop the progress thread, then free everything (see KVTransferAgent.close)."""
        self._stop_progress.set()
        self._reads_expected.set()  # wakes a sleeping progress thread so it sees the stop
        if threading.current_thread() is not self._progress_thread:
            self._progress_thread.join(timeout=5)
        super().close()

    def _close_backend(self) -> None:
        self._bind_device()
        try:
            self._staging.close()
            self._local_dlist.release()
            self._agent.deregister_memory(self._registration)
        except Exception:
            logger.warning("releasing NIXL registration of %r failed", self.name,
                           exc_info=True)
        # Drop every reference so the agent and its UCX worker are destroyed now.
        self._local_dlist = self._registration = self._agent = None
