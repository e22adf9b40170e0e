"""The pieces of the trust boundary on a bare gRPC server (no model, no Ray): mTLS refuses a
client without a certificate or with one from another CA, the API key interceptor refuses a
missing or wrong key and lets health through, and servers never advertise a wildcard."""

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.cluster.certs import issue, make_ca
from pdserve.protos import worker_pb2, worker_pb2_grpc
from pdserve.router.auth import ApiKeyError, ApiKeyInterceptor, read_key
from pdserve.wire import tls
from pdserve.wire.address import resolve
from pdserve.wire.grpc_util import aio_channel, aio_server, bind
from pdserve.wire.server import add_health, set_serving


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """Our CA with a server and a client certificate, and a stranger's CA with one client."""
    out = tmp_path_factory.mktemp("certs")
    ca = make_ca(out / "ours")
    other = make_ca(out / "other", name="someone else's CA")
    mine = {name: issue(ca, out / "ours", name) for name in ("prefill", "router")}
    return {"ca": ca, "other": issue(other, out / "other", "router"), **mine}


def config(issued, ca) -> tls.TlsConfig:
    return tls.load(str(issued.cert), str(issued.key), str(ca.cert), prefix="tls")


class Stats(worker_pb2_grpc.PrefillWorkerServicer):
    async def Stats(self, request, context):
        return worker_pb2.WorkerStats(worker_id="w")


async def serve(server_tls=None, interceptors=()):
    server = aio_server(interceptors)
    address = bind(server, "127.0.0.1", 0, server_tls)
    worker_pb2_grpc.add_PrefillWorkerServicer_to_server(Stats(), server)
    health = add_health(server, ["pdserve.v1.PrefillWorker"])
    await server.start()
    await set_serving(health, ["pdserve.v1.PrefillWorker"], True)
    return server, address


async def stats_code(address, client_tls=None, metadata=None) -> grpc.StatusCode:
    async with aio_channel(address, client_tls, peer="prefill") as ch:
        try:
            await worker_pb2_grpc.PrefillWorkerStub(ch).Stats(worker_pb2.StatsRequest(), timeout=5, metadata=metadata)
            return grpc.StatusCode.OK
        except grpc.aio.AioRpcError as exc:
            return exc.code()


def test_mtls_refuses_strangers(certs):
    ours = config(certs["router"], certs["ca"])
    stranger = config(certs["other"], certs["ca"])  # trusts our CA, but its own cert is from another

    async def main():
        server, address = await serve(config(certs["prefill"], certs["ca"]))
        try:
            assert await stats_code(address, ours) == grpc.StatusCode.OK
            assert await stats_code(address, None) == grpc.StatusCode.UNAVAILABLE  # plaintext: no handshake
            no_cert = tls.TlsConfig(cert_pem=b"", ca_pem=ours.ca_pem)
            async with grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(ours.ca_pem),
                                               options=no_cert.channel_options("prefill")) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await worker_pb2_grpc.PrefillWorkerStub(ch).Stats(worker_pb2.StatsRequest(), timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert await stats_code(address, stranger) == grpc.StatusCode.UNAVAILABLE
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_tls_settings_are_all_or_nothing(certs, tmp_path):
    assert tls.load(None, None, None, prefix="tls") is None
    with pytest.raises(tls.TlsConfigError, match="tls_key, tls_ca"):
        tls.load(str(certs["router"].cert), None, None, prefix="tls")
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(tls.TlsConfigError, match="tls_ca: .*junk.pem is not a PEM"):
        tls.load(str(certs["router"].cert), str(certs["router"].key), str(tmp_path / "junk.pem"), prefix="tls")
    assert "PRIVATE" not in repr(config(certs["router"], certs["ca"]))


def test_api_key_interceptor():
    async def main():
        server, address = await serve(interceptors=[ApiKeyInterceptor("s3cret")])
        try:
            assert await stats_code(address) == grpc.StatusCode.UNAUTHENTICATED
            assert await stats_code(address, metadata=(("authorization", "Bearer nope"),)) \
                == grpc.StatusCode.UNAUTHENTICATED
            assert await stats_code(address, metadata=(("authorization", "Bearer s3cret"),)) == grpc.StatusCode.OK
            async with aio_channel(address) as ch:  # load balancers probe health without the key
                resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert resp.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_api_key_from_file(tmp_path):
    (tmp_path / "key").write_text("from-file\n")
    assert read_key(None, str(tmp_path / "key")) == "from-file"
    assert read_key("k", None) == "k" and read_key(None, None) is None
    with pytest.raises(ApiKeyError, match="both set"):
        read_key("k", str(tmp_path / "key"))
    with pytest.raises(ApiKeyError, match="api_key_file: cannot read"):
        read_key(None, str(tmp_path / "missing"))


def test_a_wildcard_bind_is_never_advertised():
    assert resolve("0.0.0.0").bind_host == "0.0.0.0"
    assert resolve("0.0.0.0").advertise_host not in ("0.0.0.0", "")
    assert resolve("0.0.0.0", "10.1.2.3").advertise(80) == "10.1.2.3:80"
    assert resolve("127.0.0.2").advertise(7) == "127.0.0.2:7"


def test_public_tls_without_client_certificates(certs):
    """The public plane takes a server certificate alone; clients need only trust its CA."""
    public = tls.load(str(certs["router"].cert), str(certs["router"].key), None, prefix="public_tls",
                      require_ca=False)
    ca_pem = certs["ca"].cert.read_bytes()

    async def main():
        server, address = await serve(public)
        try:
            creds = grpc.ssl_channel_credentials(ca_pem)
            async with grpc.aio.secure_channel(address, creds, options=public.channel_options("router")) as ch:  # the certificate names router
                stats = await worker_pb2_grpc.PrefillWorkerStub(ch).Stats(worker_pb2.StatsRequest(), timeout=5)
                assert stats.worker_id == "w"
            assert await stats_code(address) == grpc.StatusCode.UNAVAILABLE  # plaintext to a TLS port
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_https_front_with_api_key(certs):
    """The OpenAI front over HTTPS: /health open, /v1 behind the key (no model needed for these)."""
    import ssl
    import urllib.error
    import urllib.request
    from types import SimpleNamespace

    from pdserve.router import http_api
    from pdserve.router.auth import ApiKeys
    from pdserve.router.limits import RouterLimits

    public = tls.load(str(certs["router"].cert), str(certs["router"].key), None, prefix="public_tls",
                      require_ca=False)
    service = SimpleNamespace(pool=SimpleNamespace(ready=lambda: True, degraded=lambda: [], missing_roles=lambda: []), limits=RouterLimits(), draining=False, unready=False,
                              model=SimpleNamespace(name="m", names=("m",), served_names=lambda: ("m",), max_model_len=8),
                              keys=ApiKeys.single("k"))
    client_ctx = ssl.create_default_context(cadata=certs["ca"].cert.read_text())
    client_ctx.check_hostname = False  # the certificate names pdserve.internal, the URL an IP

    def get(address, path, key=None):
        req = urllib.request.Request(f"https://{address}{path}",
                                     headers={"Authorization": f"Bearer {key}"} if key else {})
        try:
            with urllib.request.urlopen(req, timeout=10, context=client_ctx) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code

    async def main():
        runner, address = await http_api.start(service, "127.0.0.1", 0, tls=public)
        try:
            codes = await asyncio.to_thread(lambda: [get(address, "/health"), get(address, "/v1/models"),
                                                     get(address, "/v1/models", "bad"),
                                                     get(address, "/v1/models", "k")])
            assert codes == [200, 401, 401, 200]
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_tcp_block_server_binds_one_address_and_advertises_another():
    """The tcp backend's listener binds the internal plane's address and tells peers the
    advertised one (before, it always bound and advertised 127.0.0.1)."""
    import socket

    from pdserve.kv_transfer.tcp_backend import TcpAgent
    from tests.kv_transfer.kv_helpers import make_cache
    from pdserve.wire.address import Endpoint, transfer_listen_opts

    opts = transfer_listen_opts("tcp", Endpoint("127.0.0.2", "node-b.internal"))
    assert transfer_listen_opts("nixl", Endpoint("0.0.0.0", "x")) == {}  # a wildcard: UCX's default
    agent = TcpAgent("holder", make_cache(4), **opts)
    try:
        advertised = agent.local_metadata().tcp_address
        host, port = advertised.rsplit(":", 1)
        assert host == "node-b.internal"
        with socket.create_connection(("127.0.0.2", int(port)), timeout=5):
            pass  # listening on the bind address
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", int(port)), timeout=5).close()  # and only there
    finally:
        agent.close()
