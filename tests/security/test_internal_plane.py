"""The internal plane fails closed (wire.internal_plane, cluster.certs), with real gRPC and real
certificates: a worker server refuses to listen beyond loopback without mTLS unless told
``insecure_internal``; each internal RPC accepts only the roles that need it, told apart by
each role's own certificate; the public certificate is server-only and cannot call in."""

import asyncio

import grpc
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from pdserve.cluster.certs import COMPONENTS, issue, make_ca
from pdserve.protos import admin_pb2, admin_pb2_grpc, kv_transfer_pb2, worker_pb2, worker_pb2_grpc
from pdserve.wire import tls
from pdserve.wire.grpc_util import aio_channel
from pdserve.wire.internal_plane import InsecureInternalError, check_bind
from pdserve.wire.server import start_server
from pdserve.wire.tls import INTERNAL_DOMAIN

OK, DENIED = grpc.StatusCode.OK, grpc.StatusCode.PERMISSION_DENIED


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    out = tmp_path_factory.mktemp("certs")
    ca = make_ca(out)
    issued = {role: issue(ca, out, role) for role in COMPONENTS}
    issued["public"] = issue(ca, out, "public", extra_names=("127.0.0.1",), public=True)
    return {name: tls.load(str(i.cert), str(i.key), str(ca.cert), prefix="tls") for name, i in issued.items()} | {
        "public_pem": issued["public"].cert}


class FakePrefill(worker_pb2_grpc.PrefillWorkerServicer):
    async def GetAgentMetadata(self, request, context):
        return kv_transfer_pb2.AgentMetadata(agent_name="prefill-0")

    async def Drain(self, request, context):
        return worker_pb2.WorkerStats(worker_id="prefill-0")

    async def Stats(self, request, context):
        return worker_pb2.WorkerStats(worker_id="prefill-0")


class FakeElastic(worker_pb2_grpc.ElasticWorkerServicer):
    async def SetRole(self, request, context):
        return worker_pb2.SetRoleResponse(role=request.role)


class FakeAdmin(admin_pb2_grpc.RouterAdminServicer):
    async def SetMembership(self, request, context):
        return admin_pb2.MembershipAck()


def register(server, address):
    worker_pb2_grpc.add_PrefillWorkerServicer_to_server(FakePrefill(), server)
    admin_pb2_grpc.add_RouterAdminServicer_to_server(FakeAdmin(), server)
    worker_pb2_grpc.add_ElasticWorkerServicer_to_server(FakeElastic(), server)


CALLS = {
    "GetAgentMetadata": lambda ch: worker_pb2_grpc.PrefillWorkerStub(ch).GetAgentMetadata(
        worker_pb2.AgentMetadataRequest(), timeout=10),
    "Drain": lambda ch: worker_pb2_grpc.PrefillWorkerStub(ch).Drain(worker_pb2.DrainRequest(), timeout=10),
    "Stats": lambda ch: worker_pb2_grpc.PrefillWorkerStub(ch).Stats(worker_pb2.StatsRequest(), timeout=10),
    "SetMembership": lambda ch: admin_pb2_grpc.RouterAdminStub(ch).SetMembership(admin_pb2.Membership(), timeout=10),
    "SetRole": lambda ch: worker_pb2_grpc.ElasticWorkerStub(ch).SetRole(worker_pb2.SetRoleRequest(role="decode"),
                                                                       timeout=10),
}


async def code_of(address: str, client: tls.TlsConfig, method: str) -> grpc.StatusCode:
    async with aio_channel(address, client, peer="prefill") as ch:
        try:
            await CALLS[method](ch)
            return OK
        except grpc.aio.AioRpcError as exc:
            return exc.code()


def test_each_internal_rpc_accepts_only_the_roles_that_need_it(certs):
    expected = {  # (method, caller role) -> status
        ("GetAgentMetadata", "decode"): OK, ("GetAgentMetadata", "router"): DENIED,
        ("GetAgentMetadata", "controller"): DENIED, ("GetAgentMetadata", "prefill"): DENIED,
        ("Drain", "controller"): OK, ("Drain", "router"): DENIED, ("Drain", "decode"): DENIED,
        ("Stats", "router"): OK, ("Stats", "controller"): OK, ("Stats", "decode"): DENIED,
        ("SetMembership", "controller"): OK, ("SetMembership", "router"): DENIED,
        ("SetMembership", "decode"): DENIED, ("SetMembership", "prefill"): DENIED,  # old code: both OK
        ("SetRole", "controller"): OK, ("SetRole", "router"): DENIED, ("SetRole", "decode"): DENIED,
    }

    async def main():
        running = await start_server("127.0.0.1", 0, register, "pdserve.v1.PrefillWorker", [], tls=certs["prefill"])
        try:
            return {key: await code_of(running.address, certs[key[1]], key[0]) for key in expected}
        finally:
            await running.stop(0)

    assert asyncio.run(main()) == expected


def test_the_public_certificate_is_server_only_and_cannot_call_in(certs):
    cert = x509.load_pem_x509_certificate(certs["public_pem"].read_bytes())
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    names, uris = sans.get_values_for_type(x509.DNSName), sans.get_values_for_type(x509.UniformResourceIdentifier)
    assert list(usage) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert not uris and not any(n.endswith(INTERNAL_DOMAIN) for n in names)

    async def main():
        running = await start_server("127.0.0.1", 0, register, "pdserve.v1.PrefillWorker", [], tls=certs["prefill"])
        try:
            return await code_of(running.address, certs["public"], "SetMembership")
        finally:
            await running.stop(0)

    assert asyncio.run(main()) == grpc.StatusCode.UNAVAILABLE  # the handshake refuses it


def test_a_worker_server_beyond_loopback_without_mtls_is_refused():
    async def main():
        await start_server("0.0.0.0", 0, register, "pdserve.v1.PrefillWorker", [])

    with pytest.raises(InsecureInternalError, match="--insecure-internal"):
        asyncio.run(main())


@pytest.mark.parametrize("host,mtls,insecure,refused", [
    ("0.0.0.0", False, False, True), ("10.1.2.3", False, False, True), ("::", False, False, True),
    ("127.0.0.1", False, False, False), ("::1", False, False, False), ("localhost", False, False, False),
    ("10.1.2.3", True, False, False), ("10.1.2.3", False, True, False),
])
def test_check_bind(certs, host, mtls, insecure, refused):
    server_tls = certs["prefill"] if mtls else None
    if refused:
        with pytest.raises(InsecureInternalError, match="tls_ca"):
            check_bind(host, server_tls, insecure, "pdserve.v1.PrefillWorker")
    else:
        check_bind(host, server_tls, insecure, "pdserve.v1.PrefillWorker")
