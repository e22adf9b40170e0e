"""A read's arguments, checked against the two caches, made into its ``TransferHandle``
(``KVTransferAgent.start_read`` documents them)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Optional

from pdserve.kv_transfer import checksum
from pdserve.kv_transfer.errors import InvalidTransferRequest
from pdserve.kv_transfer.layout import CacheLayout
from pdserve.kv_transfer.metadata import block_ids
from pdserve.kv_transfer.read import TransferHandle
from pdserve.kv_transfer.sharding import HeadSlice
from pdserve.protos import kv_transfer_pb2


def checked_read(transfer_id: int, peer: str, meta: kv_transfer_pb2.AgentMetadata, layout: CacheLayout,
                 hs: Optional[HeadSlice], remote_block_ids: Sequence[int], local_block_ids: Sequence[int],
                 notify: bytes, last_block_bytes: Optional[int], checksums: Optional[Sequence[int]],
                 inject_delay_s: float) -> TransferHandle:
    """The handle of a read of ``peer`` (whose metadata is ``meta``; ``hs``: what a read of it
    moves, None: whole blocks) into this agent's cache (``layout``), posted ``inject_delay_s``
    from now. Raises InvalidTransferRequest naming the field and the limit."""
    remote = block_ids("remote_block_ids", remote_block_ids, meta.num_blocks)
    local = block_ids("local_block_ids", local_block_ids, layout.num_blocks)
    if len(remote) != len(local):
        raise InvalidTransferRequest(
            f"remote_block_ids has {len(remote)} ids but local_block_ids has "
            f"{len(local)}; they pair up one to one", field="local_block_ids",
            limit=len(remote), peer=peer)
    if len(set(local)) != len(local):
        raise InvalidTransferRequest("local_block_ids must not repeat a block",
                                     field="local_block_ids", peer=peer)
    if not isinstance(notify, bytes):
        raise InvalidTransferRequest(
            f"notify must be bytes, got {type(notify).__name__}", field="notify")
    block_bytes = layout.block_bytes
    last = block_bytes if last_block_bytes is None else int(last_block_bytes)
    if not 0 < last <= block_bytes or not local:
        raise InvalidTransferRequest(
            f"last_block_bytes must be in (0, {block_bytes}] with at least one block, "
            f"got {last_block_bytes}", field="last_block_bytes", limit=block_bytes, peer=peer)
    if hs is None:
        sums, last_rows = checksum.checksums_arg(checksums, len(local), peer), 0
        nbytes = (len(local) - 1) * block_bytes + last
    else:
        last_rows = hs.last_rows(last)
        if checksums is not None and hs.groups == 0:
            raise InvalidTransferRequest(f"peer {peer!r} sums its heads in groups the heads read here do not "
                                         "fall on: its reads cannot be checked", field="checksums", peer=peer)
        sums, nbytes = checksum.checksums_arg(checksums, len(local), peer, hs.groups), hs.nbytes(len(local), last_rows)
    now = time.monotonic()
    return TransferHandle(
        transfer_id=transfer_id, peer=peer, remote_block_ids=remote,
        local_block_ids=local, notify=notify, last_block_bytes=last, nbytes=nbytes, started_at=now,
        post_at=now + inject_delay_s, checksums=sums, slice=hs, last_rows=last_rows)
