"""Misuse of the transfer API fails loudly with errors that name the field and the limit.

Two agents in this process are enough here: every check happens before bytes move."""

import socket
import sys

import pytest
import torch
from kv_helpers import BACKENDS, BLOCK_BYTES, make_cache

from pdserve.kv_transfer.base import MAX_PEER_BLOCKS
from pdserve.kv_transfer import (BackendUnavailable, InvalidTransferRequest, TransferError,
                         TransferState, create_agent)
from pdserve.protos import kv_transfer_pb2


@pytest.fixture(scope="module", params=BACKENDS)
def pair(request):
    holder = create_agent(request.param, "err-holder", make_cache(8, seed=1))
    reader = create_agent(request.param, "err-reader", make_cache(4))
    peer = reader.add_remote(holder.local_metadata())
    yield reader, peer, holder
    reader.close()
    holder.close()


@pytest.mark.parametrize("remote, local, field, limit", [
    ([8], [0], "remote_block_ids", 8),
    ([-1], [0], "remote_block_ids", 8),
    ([0], [4], "local_block_ids", 4),
    ([0, 1], [0], "local_block_ids", 2),
    ([], [], "remote_block_ids", 1),
])
def test_bad_block_ids_name_field_and_limit(pair, remote, local, field, limit):
    reader, peer, _ = pair
    with pytest.raises(InvalidTransferRequest) as err:
        reader.start_read(peer, remote, local, b"")
    assert (err.value.field, err.value.limit) == (field, limit)
    assert field in str(err.value)
    assert reader.in_flight() == 0


def test_repeated_local_block_and_unknown_peer_are_rejected(pair):
    reader, peer, _ = pair
    with pytest.raises(InvalidTransferRequest, match="must not repeat") as err:
        reader.start_read(peer, [0, 1], [2, 2], b"")
    assert err.value.field == "local_block_ids"
    with pytest.raises(InvalidTransferRequest, match="unknown peer 'nobody'"):
        reader.start_read("nobody", [0], [0], b"")


def test_block_bytes_mismatch_is_rejected_naming_both_values(pair):
    reader, _, _ = pair
    other = create_agent(reader.backend_name, "wide", torch.zeros(4, BLOCK_BYTES * 2,
                                                                 dtype=torch.uint8))
    try:
        with pytest.raises(InvalidTransferRequest) as err:
            reader.add_remote(other.local_metadata())
        assert err.value.field == "block_bytes"
        assert str(BLOCK_BYTES * 2) in str(err.value) and str(BLOCK_BYTES) in str(err.value)
    finally:
        other.close()


def test_metadata_from_another_backend_is_rejected(pair):
    reader, _, holder = pair
    meta = holder.local_metadata()
    meta.backend = "tcp" if reader.backend_name == "nixl" else "nixl"
    meta.agent_name = "other-backend"
    with pytest.raises(InvalidTransferRequest) as err:
        reader.add_remote(meta)
    assert err.value.field == "backend"


def test_metadata_survives_protobuf_round_trip(pair):
    _, _, holder = pair
    meta = holder.local_metadata()
    parsed = kv_transfer_pb2.AgentMetadata.FromString(meta.SerializeToString())
    assert parsed == meta
    assert (parsed.block_bytes, parsed.num_blocks) == (BLOCK_BYTES, 8)
    assert parsed.memory_type == kv_transfer_pb2.AgentMetadata.MEMORY_TYPE_DRAM
    assert bool(parsed.backend_metadata) == (holder.backend_name == "nixl")
    assert bool(parsed.tcp_address) == (holder.backend_name == "tcp")


def test_finished_read_cannot_be_cancelled_or_recounted(pair):
    reader, peer, _ = pair
    handle = reader.start_read(peer, [3], [0], b"")
    assert reader.wait(handle, timeout_s=10) == TransferState.DONE, handle.error
    before = reader.stats.snapshot()
    assert reader.cancel(handle) == TransferState.DONE
    assert reader.poll(handle) == TransferState.DONE
    assert reader.stats.snapshot() == before


def test_handle_of_another_agent_is_rejected(pair):
    reader, peer, holder = pair
    delayed = create_agent(reader.backend_name, "delayed", make_cache(4), inject_delay_s=30)
    try:
        handle = delayed.start_read(delayed.add_remote(holder.local_metadata()), [0], [0])
        with pytest.raises(InvalidTransferRequest) as err:
            reader.poll(handle)
        assert err.value.field == "handle"
    finally:
        delayed.close()


def test_unknown_backend_names_the_config_field():
    with pytest.raises(ValueError, match="kv_transfer_backend must be one of nixl, tcp"):
        create_agent("rdma", "x", make_cache(2))


def test_non_contiguous_cache_is_rejected():
    with pytest.raises(InvalidTransferRequest) as err:
        create_agent("tcp", "x", make_cache(4).transpose(0, 1))
    assert err.value.field == "cache"


def test_closed_agent_refuses_work():
    agent = create_agent("tcp", "closing", make_cache(2))
    agent.close()
    agent.close()  # idempotent
    with pytest.raises(TransferError, match="closed"):
        agent.local_metadata()


def test_nixl_missing_raises_backend_unavailable(monkeypatch):
    for name in ("nixl_cu12", "nixl_cu13"):
        monkeypatch.setitem(sys.modules, name, None)  # import now fails as if absent
    with pytest.raises(BackendUnavailable, match="'nixl' is unavailable: no NIXL module loads") as err:
        create_agent("nixl", "no-nixl", make_cache(2))
    assert err.value.backend == "nixl"


def test_tcp_port_in_use_raises_backend_unavailable():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(BackendUnavailable, match=f"'tcp' is unavailable: cannot listen "
                                                     f"on 127.0.0.1:{port}"):
            create_agent("tcp", "no-port", make_cache(2), port=port)


def test_state_order():
    assert TransferState.PENDING < TransferState.TRANSFERRING < TransferState.DONE
    assert not TransferState.TRANSFERRING.is_terminal
    assert all(s.is_terminal for s in (TransferState.DONE, TransferState.FAILED,
                                       TransferState.CANCELLED))


@pytest.mark.parametrize("num_blocks, base_address, limit", [
    (MAX_PEER_BLOCKS + 1, None, MAX_PEER_BLOCKS),
    (2**32 - 1, None, MAX_PEER_BLOCKS),  # the most the field holds
    (8, 2**64 - 4 * BLOCK_BYTES, 4),  # a cache that would run past the end of the address space
])
def test_a_peer_announcing_more_blocks_than_sane_is_refused_before_anything_is_sized(pair, num_blocks, base_address,
                                                                                    limit):
    """A peer's ``num_blocks`` sizes the descriptor table this agent builds for it (NIXL: 24
    bytes a block): it is bounded by ``max_peer_blocks`` and by the address space, before any
    allocation, and the peer already known is left as it was. The old agent built a 100 MiB
    table for a peer announcing 2**22 + 1 blocks, and a 96 GiB one for 2**32 - 1."""
    reader, peer, holder = pair
    meta = holder.local_metadata()
    meta.num_blocks = num_blocks
    if base_address is not None:
        meta.base_address = base_address
    with pytest.raises(InvalidTransferRequest) as err:
        reader.add_remote(meta)
    assert (err.value.field, err.value.limit, err.value.peer) == ("num_blocks", limit, "err-holder")
    assert f"num_blocks={num_blocks}" in str(err.value)
    handle = reader.start_read(peer, [1], [0], b"")  # the known peer still reads
    assert reader.wait(handle, timeout_s=10) == TransferState.DONE, handle.error


def test_max_peer_blocks_is_configurable_and_checked(pair):
    reader, _, holder = pair
    small = create_agent(reader.backend_name, "small-reader", make_cache(2), max_peer_blocks=4)
    try:
        with pytest.raises(InvalidTransferRequest, match="max_peer_blocks=4") as err:
            small.add_remote(holder.local_metadata())  # 8 blocks
        assert err.value.limit == 4
    finally:
        small.close()
    with pytest.raises(InvalidTransferRequest) as err:
        create_agent(reader.backend_name, "no-peers", make_cache(2), max_peer_blocks=0)
    assert err.value.field == "max_peer_blocks"
