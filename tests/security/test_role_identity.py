"""Least privilege on the internal plane, both ends of a call (wire.internal_plane, wire.tls,
cluster.certs), with real gRPC servers and real certificates of one CA:

- each certificate names its roles (SAN URIs ``spiffe://pdserve/<role>``, DNS names
  ``<role>.pdserve.internal``); an elastic worker's names both pools';
- a channel checks the server it reached holds the role it meant to call: a decode worker's
  certificate cannot serve as a prefill worker, nor a worker's as the router's admin;
- a server refuses a method ``ALLOWED`` does not list, to every caller, and checks handlers
  that take a stream of requests as it checks the rest;
- only the controller replaces the routing table; a worker joins and leaves as itself only:
  as the role it holds, at a host its certificate names, replacing no member of another role.
"""

import asyncio

import grpc
import pytest
from cryptography import x509

from pdserve.cluster.certs import COMPONENTS, issue, make_ca
from pdserve.protos import admin_pb2, admin_pb2_grpc, worker_pb2, worker_pb2_grpc
from pdserve.router.admin import RouterAdminService
from pdserve.router.pool import WorkerPool
from pdserve.wire import internal_plane, tls
from pdserve.wire.grpc_util import aio_channel
from pdserve.wire.server import start_server
from tests.helpers.certs import role_certs

OK, DENIED, REFUSED = grpc.StatusCode.OK, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAVAILABLE
HIDDEN = "/pdserve.test.Hidden/"  # a service the internal plane does not list


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """Each component's, and two decode workers' own (naming the hosts they serve at)."""
    return role_certs(tmp_path_factory.mktemp("certs"),
                      hosts={"decode-a": ("10.0.0.2",), "decode-on-prefill-host": ("10.0.0.1",)})


class Prefill(worker_pb2_grpc.PrefillWorkerServicer):
    async def Stats(self, request, context):
        return worker_pb2.WorkerStats(worker_id="prefill-0")


def hidden_handlers() -> grpc.GenericRpcHandler:
    """An unlisted unary method, and a client-streaming and a bidi one (no pdserve RPC streams
    its requests today; a future one must be checked all the same)."""
    async def echo(request, context):
        return request

    async def count(requests, context):
        return str(len([r async for r in requests])).encode()

    async def bidi(requests, context):
        async for r in requests:
            yield r

    return grpc.method_handlers_generic_handler("pdserve.test.Hidden", {
        "Echo": grpc.unary_unary_rpc_method_handler(echo),
        "Count": grpc.stream_unary_rpc_method_handler(count),
        "Bidi": grpc.stream_stream_rpc_method_handler(bidi),
    })


def register(server, address):
    worker_pb2_grpc.add_PrefillWorkerServicer_to_server(Prefill(), server)
    admin_pb2_grpc.add_RouterAdminServicer_to_server(RouterAdminService(WorkerPool()), server)
    server.add_generic_rpc_handlers((hidden_handlers(),))


async def serving(server_tls):
    return await start_server("127.0.0.1", 0, register, "pdserve.v1.PrefillWorker", [], tls=server_tls)


async def code(coro) -> grpc.StatusCode:
    try:
        await coro
        return OK
    except grpc.aio.AioRpcError as exc:
        return exc.code()


def test_each_certificate_names_its_roles(certs):
    def sans(config):
        value = x509.load_pem_x509_certificate(config.cert_pem).extensions.get_extension_for_class(
            x509.SubjectAlternativeName).value
        return (set(value.get_values_for_type(x509.UniformResourceIdentifier)),
                set(value.get_values_for_type(x509.DNSName)))

    assert sans(certs["decode"]) == ({"spiffe://pdserve/decode"}, {"decode.pdserve.internal"})
    assert sans(certs["elastic"]) == ({"spiffe://pdserve/prefill", "spiffe://pdserve/decode"},
                                      {"prefill.pdserve.internal", "decode.pdserve.internal"})
    assert tls.certificate_roles(certs["controller"].cert_pem) == {"controller"}


def test_a_decode_certificate_posing_as_a_prefill_server_is_refused_by_its_caller(certs):
    """Old code: every certificate was a server for the one name pdserve.internal, so the
    router's channel to "a prefill worker" took a decode worker's certificate."""
    async def main():
        impostor = await serving(certs["decode"])
        genuine = await serving(certs["prefill"])
        try:
            calls = {}
            for name, running in (("impostor", impostor), ("genuine", genuine)):
                async with aio_channel(running.address, certs["router"], peer="prefill") as ch:
                    calls[name] = await code(worker_pb2_grpc.PrefillWorkerStub(ch).Stats(worker_pb2.StatsRequest(),
                                                                                        timeout=5))
            async with aio_channel(impostor.address, certs["router"], peer="decode") as ch:  # what it is
                calls["as-decode"] = await code(worker_pb2_grpc.PrefillWorkerStub(ch).Stats(worker_pb2.StatsRequest(),
                                                                                           timeout=5))
            async with aio_channel(genuine.address, certs["decode"], peer="router") as ch:  # a worker is no admin
                calls["as-admin"] = await code(admin_pb2_grpc.RouterAdminStub(ch).GetMembership(admin_pb2.Membership(),
                                                                                               timeout=5))
            return calls
        finally:
            await impostor.stop(0)
            await genuine.stop(0)

    assert asyncio.run(main()) == {"impostor": REFUSED, "genuine": OK, "as-decode": OK, "as-admin": REFUSED}


def test_an_elastic_worker_serves_and_calls_as_both_roles(certs):
    async def main():
        running = await serving(certs["elastic"])
        try:
            codes = []
            for peer in ("prefill", "decode"):
                async with aio_channel(running.address, certs["router"], peer=peer) as ch:
                    codes.append(await code(worker_pb2_grpc.PrefillWorkerStub(ch).Stats(worker_pb2.StatsRequest(),
                                                                                       timeout=5)))
            return codes
        finally:
            await running.stop(0)

    assert asyncio.run(main()) == [OK, OK]


async def _streaming_code(ch: grpc.aio.Channel, kind: str, send: bool) -> grpc.StatusCode:
    """The status of a call to the hidden client-streaming or bidi method. A caller that
    expects a refusal writes nothing: gRPC's client reports INTERNAL, not the server's status,
    when a write meets a call the server has just ended (grpcio's ``set_internal_error``), and
    a CI run once caught that race. Writing nothing loses no strength: a handler whose role
    check were skipped would wait on the requests until the 5 s deadline."""
    method = ch.stream_unary(HIDDEN + "Count") if kind == "client-streaming" else ch.stream_stream(HIDDEN + "Bidi")
    call = method(timeout=5)  # reader-writer style: the test decides what it writes
    if send:
        for request in (b"a", b"b"):
            await call.write(request)
        await call.done_writing()
    if kind == "bidi":
        async def answers():
            while await call.read() is not grpc.aio.EOF:  # a bidi call ends once its answers are read
                pass
        return await code(answers())
    return await call.code()


async def _hidden_codes(ch: grpc.aio.Channel, send: bool) -> dict[str, grpc.StatusCode]:
    return {"unary": await code(ch.unary_unary(HIDDEN + "Echo")(b"x", timeout=5)),
            "client-streaming": await _streaming_code(ch, "client-streaming", send),
            "bidi": await _streaming_code(ch, "bidi", send)}


def test_an_unlisted_method_is_refused_and_streaming_requests_are_checked(certs, monkeypatch):
    """Old code: a method missing from ALLOWED, and any handler taking a stream of requests,
    skipped the role check (all three answered OK)."""
    async def calls(client, peer, send=False):
        running = await serving(certs["prefill"] if client else None)
        try:
            async with aio_channel(running.address, client, peer=peer) as ch:
                return await _hidden_codes(ch, send)
        finally:
            await running.stop(0)

    unlisted = asyncio.run(calls(certs["controller"], "prefill"))
    plaintext = asyncio.run(calls(None, None))  # loopback without mTLS: no roles, but still not listed
    assert unlisted == {"unary": DENIED, "client-streaming": DENIED, "bidi": DENIED}
    assert plaintext == unlisted
    for method in ("Count", "Bidi"):
        monkeypatch.setitem(internal_plane.ALLOWED, HIDDEN + method, frozenset({"decode"}))
    wrong = asyncio.run(calls(certs["router"], "prefill"))
    right = asyncio.run(calls(certs["decode"], "prefill", send=True))
    assert (wrong["client-streaming"], wrong["bidi"]) == (DENIED, DENIED)
    assert (right["client-streaming"], right["bidi"]) == (OK, OK)


PREFILL_AT, DECODE_A_AT, DECODE_B_AT = "10.0.0.1:50061", "10.0.0.2:50061", "10.0.0.3:50061"


def member(role: str, address: str = "127.0.0.1:1") -> admin_pb2.Member:
    return admin_pb2.Member(role=role, address=address, worker_id="w")


async def membership_calls(certs, calls) -> tuple[dict, list[tuple[str, str]]]:
    """Against a router whose table the controller set to a prefill worker and a decode worker
    (B): each ``(name, certificate, method, member)`` of ``calls`` in turn, its status and
    details; then the table."""
    running = await serving(certs["router"])
    try:
        async with aio_channel(running.address, certs["controller"], peer="router") as ch:
            await admin_pb2_grpc.RouterAdminStub(ch).SetMembership(admin_pb2.Membership(
                members=[member("prefill", PREFILL_AT), member("decode", DECODE_B_AT)]), timeout=10)
        out = {}
        for name, who, method, request in calls:
            async with aio_channel(running.address, certs[who], peer="router") as ch:
                try:
                    await getattr(admin_pb2_grpc.RouterAdminStub(ch), method)(request, timeout=10)
                    out[name] = (OK, "")
                except grpc.aio.AioRpcError as exc:
                    out[name] = (exc.code(), exc.details())
        async with aio_channel(running.address, certs["controller"], peer="router") as ch:
            table = await admin_pb2_grpc.RouterAdminStub(ch).GetMembership(admin_pb2.Membership(), timeout=10)
        return out, sorted((m.role, m.address) for m in table.members)
    finally:
        await running.stop(0)


def test_only_the_controller_replaces_the_table_and_a_worker_joins_as_its_own_role(certs):
    async def main():
        running = await serving(certs["router"])
        try:
            out = {}
            for who in ("decode", "prefill", "controller"):
                async with aio_channel(running.address, certs[who], peer="router") as ch:
                    out[("set", who)] = await code(admin_pb2_grpc.RouterAdminStub(ch).SetMembership(
                        admin_pb2.Membership(members=[member("prefill")]), timeout=10))
            async with aio_channel(running.address, certs["decode-a"], peer="router") as ch:
                admin = admin_pb2_grpc.RouterAdminStub(ch)
                out["join as prefill"] = await code(admin.Join(member("prefill", DECODE_A_AT), timeout=10))
                out["leave as prefill"] = await code(admin.Leave(member("prefill", DECODE_A_AT), timeout=10))
                out["join as decode"] = await code(admin.Join(member("decode", DECODE_A_AT), timeout=10))
            return out
        finally:
            await running.stop(0)

    out = asyncio.run(main())
    assert (out[("set", "decode")], out[("set", "prefill")], out[("set", "controller")]) == (DENIED, DENIED, OK)
    assert (out["join as prefill"], out["leave as prefill"], out["join as decode"]) == (DENIED, DENIED, OK)


def test_a_worker_joins_and_leaves_only_as_itself_and_moves_no_other_member(certs):
    """Decode worker A's certificate names its host (10.0.0.2). It cannot list itself at the
    prefill worker's address (which would drop that worker from the pool), take out decode
    worker B, or join at all with a certificate that names no host; each is refused, naming
    why, and the controller's table stays as it was. Old code: the join at the prefill worker's
    address replaced it, and the leave took B out. As itself, A joins, joins again as a
    restarted worker does (no change), and leaves."""
    calls = [("join at the prefill worker's address", "decode-a", "Join", member("decode", PREFILL_AT)),
             ("leave for decode worker B", "decode-a", "Leave", member("decode", DECODE_B_AT)),
             ("join at B's address", "decode-a", "Join", member("decode", DECODE_B_AT)),
             ("no host named", "decode", "Join", member("decode", DECODE_A_AT))]
    refused, table = asyncio.run(membership_calls(certs, calls))
    assert table == [("decode", DECODE_B_AT), ("prefill", PREFILL_AT)]  # unchanged
    assert {name: status for name, (status, _) in refused.items()} == {name: DENIED for name, *_ in calls}
    assert "names 10.0.0.2, not 10.0.0.1 of 10.0.0.1:50061" in refused["join at the prefill worker's address"][1]
    assert "its own address" in refused["leave for decode worker B"][1]
    assert "names no host" in refused["no host named"][1]

    own = [("join", "decode-a", "Join", member("decode", DECODE_A_AT)),
           ("rejoin", "decode-a", "Join", member("decode", DECODE_A_AT)),
           ("leave", "decode-a", "Leave", member("decode", DECODE_A_AT))]
    done, table = asyncio.run(membership_calls(certs, own[:2]))
    assert done == {"join": (OK, ""), "rejoin": (OK, "")}
    assert table == [("decode", DECODE_A_AT), ("decode", DECODE_B_AT), ("prefill", PREFILL_AT)]
    done, table = asyncio.run(membership_calls(certs, own))
    assert done["leave"] == (OK, "") and table == [("decode", DECODE_B_AT), ("prefill", PREFILL_AT)]


def test_a_join_never_replaces_a_member_of_a_role_the_certificate_does_not_name(certs):
    """Two workers on one host, each certificate naming it: the decode worker's Join at the
    prefill worker's address (same host) is refused all the same, the prefill entry kept."""
    calls = [("join over the prefill entry", "decode-on-prefill-host", "Join", member("decode", PREFILL_AT))]
    refused, table = asyncio.run(membership_calls(certs, calls))
    status, details = refused["join over the prefill entry"]
    assert status == DENIED and "listed as a prefill worker" in details
    assert table == [("decode", DECODE_B_AT), ("prefill", PREFILL_AT)]


def test_a_certificate_that_does_not_name_its_role_is_refused_at_start(tmp_path):
    """`pdserve worker --role prefill` with a decode certificate, and a --tls-dir whose
    certificates name no role (the layout before roles were SAN URIs), stop before anything
    starts, naming the file. Old code started, and every call between the roles failed."""
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    import argparse
    import dataclasses

    from pdserve.cluster.plain_process import internal_tls
    from pdserve.cluster.serve_config import _role_tls
    from pdserve.cluster.settings import resolve

    ca = make_ca(tmp_path)
    decode = {name: issue(ca, tmp_path, name) for name in COMPONENTS}["decode"]
    with pytest.raises(tls.TlsConfigError, match="names decode, not prefill"):
        internal = resolve(argparse.Namespace(), environ={}).internal  # the defaults: no TLS
        internal_tls(dataclasses.replace(internal, tls_cert=str(decode.cert), tls_key=str(decode.key),
                                         tls_ca=str(ca.cert)), "prefill")

    old = tmp_path / "old"
    old.mkdir()
    (old / "ca.pem").write_bytes(ca.cert.read_bytes())
    ca_cert = x509.load_pem_x509_certificate(ca.cert.read_bytes())
    ca_key = serialization.load_pem_private_key(ca.key.read_bytes(), password=None)
    for component in ("router", "prefill", "decode", "controller"):  # CN pdserve-<role>, DNS pdserve.internal
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, f"pdserve-{component}")])
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(ca_cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(ca_cert.not_valid_before_utc)
                .not_valid_after(ca_cert.not_valid_after_utc)
                .add_extension(x509.SubjectAlternativeName([x509.DNSName("pdserve.internal")]), critical=False)
                .sign(ca_key, hashes.SHA256()))
        (old / f"{component}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (old / f"{component}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    with pytest.raises(tls.TlsConfigError, match="router.pem: the certificate names no role"):
        _role_tls(dataclasses.replace(internal, tls_dir=str(old)), elastic_roles=False)
    assert [c for c, _ in _role_tls(dataclasses.replace(internal, tls_dir=str(tmp_path)), elastic_roles=False)] == [
        "router", "prefill", "decode", "controller"]


def test_a_worker_certificate_that_does_not_name_its_advertised_host_is_refused_at_start(tmp_path, capsys):
    """`pdserve worker` checks at start that its certificate names the host it advertises (the
    router would refuse every Join otherwise); `pdserve.cluster.certs --worker` issues one that
    does, and refuses a malformed request by name."""
    import argparse

    from pdserve.cluster import certs as certs_cli
    from pdserve.cluster.worker_cli import joining_tls, settings

    assert certs_cli.main([str(tmp_path), "--worker", "decode-7=decode@10.0.0.7,node-7.internal"]) == 0
    own = tls.load(str(tmp_path / "decode-7.pem"), str(tmp_path / "decode-7.key"), str(tmp_path / "ca.pem"), prefix="tls")
    assert tls.certificate_roles(own.cert_pem) == {"decode"}
    assert tls.certificate_hosts(own.cert_pem) == {"10.0.0.7", "node-7.internal"}
    assert tls.certificate_hosts((tmp_path / "decode.pem").read_bytes()) == frozenset()  # the shared one: roles only

    def worker(stem: str, advertised: str):
        environ = {"PDSERVE_ROLE": "decode", "PDSERVE_ROUTER_ADMIN": "router.internal:50052",
                   "PDSERVE_TLS_CERT": str(tmp_path / f"{stem}.pem"), "PDSERVE_TLS_KEY": str(tmp_path / f"{stem}.key"),
                   "PDSERVE_TLS_CA": str(tmp_path / "ca.pem"), "PDSERVE_INTERNAL_ADVERTISE_HOST": advertised}
        return joining_tls(settings(argparse.Namespace(), environ=environ))

    assert worker("decode-7", "NODE-7.internal") is not None and worker("decode-7", "10.0.0.7") is not None
    with pytest.raises(tls.TlsConfigError, match="names 10.0.0.7, node-7.internal, not 10.0.0.8"):
        worker("decode-7", "10.0.0.8")
    with pytest.raises(tls.TlsConfigError, match="names no host, not 10.0.0.7"):
        worker("decode", "10.0.0.7")
    with pytest.raises(SystemExit):
        certs_cli.main([str(tmp_path / "bad"), "--worker", "decode-7=router@10.0.0.7"])
    assert "ROLE prefill or decode" in capsys.readouterr().err
