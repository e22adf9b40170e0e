"""Least privilege on the internal plane, both ends of a call (wire.internal_plane, wire.tls,
cluster.certs), with real gRPC servers and real certificates of one CA:

- each certificate names its roles (SAN URIs ``spiffe://pdserve/<role>``, DNS names
  ``<role>.pdserve.internal``); an elastic worker's names both pools';
- a channel checks the server it reached holds the role it meant to call: a decode worker's
  certificate cannot serve as a prefill worker, nor a worker's as the router's admin;
- a server refuses a method ``ALLOWED`` does not list, to every caller, and checks handlers
  that take a stream of requests as it checks the rest;
- only the controller replaces the routing table; a worker joins as the role it holds only.
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

OK, DENIED, REFUSED = grpc.StatusCode.OK, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAVAILABLE
HIDDEN = "/pdserve.test.Hidden/"  # a service the internal plane does not list


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    out = tmp_path_factory.mktemp("certs")
    ca = make_ca(out)
    issued = {name: issue(ca, out, name) for name in COMPONENTS}
    return {name: tls.load(str(i.cert), str(i.key), str(ca.cert), prefix="tls") for name, i in issued.items()}


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


def _hidden_calls(ch: grpc.aio.Channel) -> dict[str, object]:
    return {
        "unary": ch.unary_unary(HIDDEN + "Echo")(b"x", timeout=5),
        "client-streaming": ch.stream_unary(HIDDEN + "Count")(iter([b"a", b"b"]), timeout=5),
    }


async def _bidi(ch: grpc.aio.Channel) -> None:
    call = ch.stream_stream(HIDDEN + "Bidi")(iter([b"a"]), timeout=5)
    async for _ in call:
        pass


def test_an_unlisted_method_is_refused_and_streaming_requests_are_checked(certs, monkeypatch):
    """Old code: a method missing from ALLOWED, and any handler taking a stream of requests,
    skipped the role check (all three answered OK)."""
    async def calls(client, peer):
        running = await serving(certs["prefill"] if client else None)
        try:
            async with aio_channel(running.address, client, peer=peer) as ch:
                out = {name: await code(call) for name, call in _hidden_calls(ch).items()}
                out["bidi"] = await code(_bidi(ch))
                return out
        finally:
            await running.stop(0)

    unlisted = asyncio.run(calls(certs["controller"], "prefill"))
    plaintext = asyncio.run(calls(None, None))  # loopback without mTLS: no roles, but still not listed
    assert unlisted == {"unary": DENIED, "client-streaming": DENIED, "bidi": DENIED}
    assert plaintext == unlisted
    for method in ("Count", "Bidi"):
        monkeypatch.setitem(internal_plane.ALLOWED, HIDDEN + method, frozenset({"decode"}))
    wrong, right = asyncio.run(calls(certs["router"], "prefill")), asyncio.run(calls(certs["decode"], "prefill"))
    assert (wrong["client-streaming"], wrong["bidi"]) == (DENIED, DENIED)
    assert (right["client-streaming"], right["bidi"]) == (OK, OK)


def test_only_the_controller_replaces_the_table_and_a_worker_joins_as_its_own_role(certs):
    member = lambda role: admin_pb2.Member(role=role, address="127.0.0.1:1", worker_id="w")  # noqa: E731

    async def main():
        running = await serving(certs["router"])
        try:
            out = {}
            for who in ("decode", "prefill", "controller"):
                async with aio_channel(running.address, certs[who], peer="router") as ch:
                    out[("set", who)] = await code(admin_pb2_grpc.RouterAdminStub(ch).SetMembership(
                        admin_pb2.Membership(members=[member("prefill")]), timeout=10))
            async with aio_channel(running.address, certs["decode"], peer="router") as ch:
                admin = admin_pb2_grpc.RouterAdminStub(ch)
                out["join as prefill"] = await code(admin.Join(member("prefill"), timeout=10))
                out["leave as prefill"] = await code(admin.Leave(member("prefill"), timeout=10))
                out["join as decode"] = await code(admin.Join(member("decode"), timeout=10))
            async with aio_channel(running.address, certs["controller"], peer="router") as ch:
                table = await admin_pb2_grpc.RouterAdminStub(ch).GetMembership(admin_pb2.Membership(), timeout=10)
            out["table"] = [(m.role, m.address) for m in table.members]
            return out
        finally:
            await running.stop(0)

    out = asyncio.run(main())
    assert (out[("set", "decode")], out[("set", "prefill")], out[("set", "controller")]) == (DENIED, DENIED, OK)
    assert (out["join as prefill"], out["leave as prefill"], out["join as decode"]) == (DENIED, DENIED, OK)
    assert out["table"] == [("decode", "127.0.0.1:1")]  # the decode join replaced the controller's prefill entry


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
