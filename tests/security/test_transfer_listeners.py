"""The KV data plane's own listeners stay on the internal plane: the tcp block server speaks
the plane's mTLS (a reader without a certificate of the cluster's CA gets no byte, even for a
claimed lease), and NIXL's UCX listens only on the interface of the worker's internal address.
Real agents in this process (no Ray); the worker test runs real gRPC workers on a tiny model."""

import asyncio
import os
import socket

import pytest
import torch

from pdserve.cluster.certs import issue, make_ca
from pdserve.kv_transfer import TransferState, create_agent
from pdserve.kv_transfer.handoff import ReleaseReason, release_request
from pdserve.protos import worker_pb2
from tests.factories import make_engine
from tests.helpers.lease_workers import PROMPT, cluster, decode, prefill_one, stats
from tests.kv_transfer.kv_helpers import make_cache
from pdserve.wire import tls
from pdserve.wire.address import Endpoint, interface_of, transfer_listen_opts


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """Two certificates of our CA, and one of a stranger's CA that trusts ours."""
    out = tmp_path_factory.mktemp("certs")
    ca, other = make_ca(out / "ours"), make_ca(out / "other", name="someone else's CA")
    load = lambda issued: tls.load(str(issued.cert), str(issued.key), str(ca.cert), prefix="tls")
    return {"holder": load(issue(ca, out / "ours", "prefill")), "reader": load(issue(ca, out / "ours", "decode")),
            "router": load(issue(ca, out / "ours", "router")), "stranger": load(issue(other, out / "other", "decode"))}


def read(reader, holder, ids=(0, 1, 2)) -> TransferState:
    peer = reader.add_remote(holder.local_metadata())
    return reader.wait(reader.start_read(peer, list(ids), list(ids), notify=b"lease"), 10)


def test_tcp_block_server_with_mtls_serves_only_readers_with_a_cluster_certificate(certs):
    with create_agent("tcp", "holder", make_cache(4, seed=3), tls=certs["holder"]) as holder, \
            create_agent("tcp", "plain", make_cache(4)) as plain, \
            create_agent("tcp", "stranger", make_cache(4), tls=certs["stranger"]) as stranger, \
            create_agent("tcp", "reader", make_cache(4), tls=certs["reader"]) as reader:
        refused = [read(plain, holder), read(stranger, holder)]
        assert holder.get_notifications() == []  # nothing was served to them
        assert read(reader, holder) is TransferState.DONE
        assert holder.get_notifications() == [b"lease"]
        assert torch.equal(reader.cache[:3], holder.cache[:3])
    assert refused == [TransferState.FAILED] * 2
    assert plain.stats.bytes == stranger.stats.bytes == 0 and not plain.cache.any() and not stranger.cache.any()


@pytest.mark.parametrize("holder, reader, served", [
    ("prefill", "decode", True),  # a prompt's KV, read by the decode worker
    ("decode", "prefill", True),  # the reversed pull: a decode worker's held prefix, read by a prefill worker
    ("prefill", "prefill", False), ("decode", "decode", False), ("prefill", "router", False),
    ("decode", "router", False)])
def test_tcp_kv_is_read_only_by_the_role_on_the_other_side_of_its_direction(certs, holder, reader, served):
    """A certificate of the cluster's CA is not enough: the router's reads nothing, and a pool
    reads only the other pool's KV. Old code: any cluster certificate could read; then a decode
    holder served only decode readers and a reader took only a prefill holder, so the reversed
    pull failed every read under mTLS."""
    by_role = {"prefill": certs["holder"], "decode": certs["reader"], "router": certs["router"]}
    with create_agent("tcp", "holder", make_cache(4, seed=3), tls=by_role[holder]) as held, \
            create_agent("tcp", "reader", make_cache(4), tls=by_role[reader]) as reading:
        state = read(reading, held)
        notified, moved = held.get_notifications(), reading.stats.bytes
        same = torch.equal(reading.cache[:3], held.cache[:3])
    if served:
        assert (state, notified, same) == (TransferState.DONE, [b"lease"], True)
    else:
        assert (state, notified, moved) == (TransferState.FAILED, [], 0) and not reading.cache.any()


def test_tcp_reader_with_mtls_refuses_a_holder_outside_the_cluster(certs):
    with create_agent("tcp", "impostor", make_cache(4, seed=3), tls=certs["stranger"]) as impostor, \
            create_agent("tcp", "reader", make_cache(4), tls=certs["reader"]) as reader:
        assert read(reader, impostor) is TransferState.FAILED
        assert not reader.cache.any()


def test_tcp_block_server_tls_needs_a_ca(certs):
    public_style = tls.TlsConfig(cert_pem=certs["holder"].cert_pem, key_pem=certs["holder"].key_pem)
    with pytest.raises(ValueError, match="tls"):
        create_agent("tcp", "holder", make_cache(2), tls=public_style)


@pytest.mark.slow
def test_workers_with_mtls_move_kv_over_tls_and_refuse_a_plain_reader(tiny_llama_dir, certs):
    """With mTLS on, the workers' tcp KV path is TLS: a reader without a certificate that holds a
    claimed lease's token still gets nothing; the rightful decode worker reads it."""
    model_dir = tiny_llama_dir[0]
    from pdserve.engine.sampling.params import SamplingParams
    expected = make_engine(model_dir).generate([PROMPT], SamplingParams(max_tokens=6, temperature=0.0,
                                                                        ignore_eos=True))[0].token_ids

    async def run():
        roles = {"prefill": certs["holder"], "decode": certs["reader"], "router": certs["router"]}
        async with cluster(model_dir, tls=roles) as (prefill, p_stub, decoders, d_stubs):
            pre = await prefill_one(p_stub)
            meta = await prefill.decode_stub.GetAgentMetadata(worker_pb2.AgentMetadataRequest(), timeout=5)
            token, ids = pre.kv.lease_token, list(pre.kv.block_ids)
            await prefill.decode_stub.Claim(worker_pb2.ClaimRequest(lease_token=token, block_ids=ids), timeout=5)
            with create_agent("tcp", "intruder", torch.zeros_like(decoders[0].engine.kv_cache)) as intruder:
                peer = intruder.add_remote(meta)
                stolen = intruder.wait(intruder.start_read(peer, ids, [0, 1, 2], notify=token.encode()), 10)
                moved = intruder.stats.snapshot().bytes
            await p_stub.Release(release_request(token, ReleaseReason.RETURNED), timeout=5)
            tokens = await decode(d_stubs[0], pre)
            return stolen, moved, [pre.first_token_id] + tokens, await stats(d_stubs[0])

    stolen, moved, tokens, reader = asyncio.run(run())
    assert stolen is TransferState.FAILED and moved == 0
    assert tokens == expected and reader.kv_transfers == 1


def _listening() -> set[str]:
    """``host:port`` of every TCP socket this process listens on (from /proc, IPv4 and IPv6)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with open(f"/proc/self/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                    continue
                host_hex, port_hex = cols[1].split(":")
                raw = bytes.fromhex(host_hex)
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # per-word little-endian
                out.add(f"{socket.inet_ntop(family, raw)}:{int(port_hex, 16)}")
    return out


def test_nixl_listens_only_on_the_internal_interface():
    """UCX's TCP transport listens on every interface it may use; a worker whose internal plane
    is on loopback holds it there. (Before, it listened on every interface of the host.)"""
    pytest.importorskip("nixl_cu12")
    opts = transfer_listen_opts("nixl", Endpoint("127.0.0.1", "127.0.0.1"))
    assert opts == {"net_devices": interface_of("127.0.0.1")}
    before = _listening()
    with create_agent("nixl", "holder", make_cache(4, seed=3), **opts) as holder, \
            create_agent("nixl", "reader", make_cache(4), **opts) as reader:
        new = _listening() - before
        assert read(reader, holder) is TransferState.DONE  # still moves KV
        assert torch.equal(reader.cache[:3], holder.cache[:3])
    assert new and all(a.startswith("127.") for a in new), new
    assert "UCX_NET_DEVICES" not in os.environ  # set only while each agent's UCX started
