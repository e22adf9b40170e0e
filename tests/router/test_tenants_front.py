"""Tenants at the router's fronts, over real gRPC and HTTP with fake workers (what is tested is
the router: tests/router/test_tenant_cache.py runs the cache part on real workers).

Two tenants behind one proxy (one connection for both, as a proxy multiplexes its clients):
B cannot abort A's request by id, while A can from any connection; A past its own limit gets
RESOURCE_EXHAUSTED / 429 naming that limit, while B is admitted; each tenant's requests run
under its own cache salt, every key of a tenant under the same one."""

import asyncio
import json
from types import SimpleNamespace

import aiohttp
import grpc
import pytest

from pdserve.protos import pdserve_pb2, pdserve_pb2_grpc
from pdserve.router import http_api
from pdserve.router.auth import ApiKeyInterceptor, ApiKeys
from pdserve.router.frontend import ModelInfo
from pdserve.router.limits import RouterLimits
from pdserve.router.service import GenerationService
from pdserve.router.tenants import Tenant, TenantLimits, key_digest
from pdserve.wire.grpc_util import aio_server, bind
from tests.metrics.metrics_helpers import FakeDecode, FakePrefill, LetterTokenizer, fake_pool

KEY_A, KEY_A2, KEY_B = "sk-tenant-a-000000001", "sk-tenant-a-000000002", "sk-tenant-b-000000003"
A = Tenant("team-a", TenantLimits(max_waiting_requests=2))
KEYS = ApiKeys(((key_digest(KEY_A), A), (key_digest(KEY_A2), A), (key_digest(KEY_B), Tenant("team-b"))))


def auth(key: str) -> tuple:
    return (("authorization", f"Bearer {key}"),)


class GatedPrefill(FakePrefill):
    """Holds every prefill of a prompt starting with token 9 until ``release``; records salts."""

    def __init__(self):
        super().__init__()
        self.release = asyncio.Event()
        self.salts: list[str] = []

    def Prefill(self, request, timeout=None) -> asyncio.Task:
        """A task, which can be cancelled as a gRPC call can (an abort cancels the call)."""
        return asyncio.ensure_future(self._prefill(request, timeout))

    async def _prefill(self, request, timeout):
        self.salts.append(request.sampling.cache_salt)
        if request.prompt_token_ids[0] == 9:
            await self.release.wait()
        return await super().Prefill(request, timeout)


def request(rid: str = "", held: bool = False, max_tokens: int = 3) -> pdserve_pb2.GenerateRequest:
    return pdserve_pb2.GenerateRequest(request_id=rid, token_ids=pdserve_pb2.TokenIds(ids=[9 if held else 5, 6, 7]),
                                       sampling=pdserve_pb2.SamplingParams(max_tokens=max_tokens))


class Router:
    """A GenerationService behind the real gRPC server (with the keys' interceptor) and HTTP front."""

    def __init__(self):
        self.prefill = GatedPrefill()
        model = ModelInfo("m", SimpleNamespace(vocab_size=1000), 4096, 16, LetterTokenizer())
        self.service = GenerationService(model, fake_pool([self.prefill], [FakeDecode()]), RouterLimits(), keys=KEYS)

    async def __aenter__(self):
        self.server = aio_server([ApiKeyInterceptor(KEYS)])
        self.address = bind(self.server, "127.0.0.1", 0)
        self.service.add_to(self.server)
        await self.server.start()
        self.http_runner, self.http_address = await http_api.start(self.service, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc):
        self.prefill.release.set()
        await self.http_runner.cleanup()
        await self.server.stop(None)

    def channel(self) -> grpc.aio.Channel:
        """A connection of its own (grpc shares one per target unless told not to)."""
        return grpc.aio.insecure_channel(self.address, options=[("grpc.use_local_subchannel_pool", 1)])

    async def wait_running(self, n: int) -> None:
        while len(self.service.running) < n:
            await asyncio.sleep(0.01)


async def responses(stream) -> list[pdserve_pb2.GenerateResponse]:
    return [r async for r in stream]


def test_b_cannot_abort_as_request_even_over_the_same_connection_and_a_can_from_another():
    async def main():
        async with Router() as router:
            async with router.channel() as proxy, router.channel() as elsewhere:
                stub = pdserve_pb2_grpc.GenerationStub(proxy)
                a_stream = asyncio.create_task(responses(stub.Generate(request("shared-id", held=True),
                                                                       metadata=auth(KEY_A), timeout=30)))
                await router.wait_running(1)
                by_b = await stub.Abort(pdserve_pb2.AbortRequest(request_id="shared-id"), metadata=auth(KEY_B),
                                        timeout=5)
                # B may run the same id at once: ids are each tenant's own
                b_own = await responses(stub.Generate(request("shared-id"), metadata=auth(KEY_B), timeout=30))
                assert not a_stream.done()
                by_a = await pdserve_pb2_grpc.GenerationStub(elsewhere).Abort(
                    pdserve_pb2.AbortRequest(request_id="shared-id"), metadata=auth(KEY_A2), timeout=5)
                a_resps = await asyncio.wait_for(a_stream, 30)
            return by_b.found, b_own[-1].finish_reason, by_a.found, a_resps[-1].finish_reason

    assert asyncio.run(main()) == (False, pdserve_pb2.FINISH_REASON_LENGTH, True, pdserve_pb2.FINISH_REASON_ABORT)


def test_a_past_its_limit_is_refused_naming_it_while_b_is_admitted():
    async def main():
        async with Router() as router:
            async with router.channel() as ch:
                stub = pdserve_pb2_grpc.GenerationStub(ch)
                held = [asyncio.create_task(responses(stub.Generate(request(held=True), metadata=auth(KEY_A),
                                                                    timeout=30))) for _ in range(2)]
                await router.wait_running(2)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await responses(stub.Generate(request(), metadata=auth(KEY_A2), timeout=30))
                trailing = dict(err.value.trailing_metadata() or ())
                b_grpc = await responses(stub.Generate(request(), metadata=auth(KEY_B), timeout=30))
                body = json.dumps({"prompt": [5, 6], "max_tokens": 2}).encode()
                async with aiohttp.ClientSession() as session:
                    url = f"http://{router.http_address}/v1/completions"
                    async with session.post(url, data=body, headers={"Authorization": f"Bearer {KEY_A}"}) as r:
                        a_http = (r.status, r.headers.get("Retry-After"), (await r.json())["error"]["message"])
                    async with session.post(url, data=body, headers={"Authorization": f"Bearer {KEY_B}"}) as r:
                        b_http = r.status
                router.prefill.release.set()
                finished = [(await asyncio.wait_for(t, 30))[-1].finish_reason for t in held]
            return err.value, trailing, b_grpc, a_http, b_http, finished

    err, trailing, b_grpc, a_http, b_http, finished = asyncio.run(main())
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and trailing.get("retry-after") == "1"
    assert "team-a" in err.details() and "max_waiting_requests=2" in err.details()
    assert b_grpc[-1].finish_reason == pdserve_pb2.FINISH_REASON_LENGTH
    assert a_http[0] == 429 and a_http[1] == "1" and "max_waiting_requests=2" in a_http[2]
    assert b_http == 200
    assert finished == [pdserve_pb2.FINISH_REASON_LENGTH] * 2  # the admitted ones were not touched


def test_each_tenant_runs_under_its_own_salt_and_a_tenants_keys_share_it():
    async def main():
        async with Router() as router:
            async with router.channel() as ch:
                stub = pdserve_pb2_grpc.GenerationStub(ch)
                for key in (KEY_A, KEY_A2, KEY_B):
                    await responses(stub.Generate(request(), metadata=auth(key), timeout=30))
            return router.prefill.salts

    a1, a2, b = asyncio.run(main())
    assert a1 == a2 == A.salt and b != a1 and b


def test_an_http_request_is_its_tenants_too():
    """An HTTP request (id from X-Request-Id) belongs to its tenant: another tenant's Abort of
    that id finds nothing, its own tenant's (over gRPC) ends it."""
    async def main():
        async with Router() as router:
            body = json.dumps({"prompt": [9, 6, 7], "max_tokens": 3, "stream": True}).encode()
            headers = {"Authorization": f"Bearer {KEY_A}", "X-Request-Id": "http-id"}
            async with aiohttp.ClientSession() as session:
                async def stream() -> str:
                    async with session.post(f"http://{router.http_address}/v1/completions", data=body,
                                            headers=headers) as r:
                        return await r.text()

                http = asyncio.create_task(stream())
                await router.wait_running(1)
                async with router.channel() as ch:
                    stub = pdserve_pb2_grpc.GenerationStub(ch)
                    by_b = await stub.Abort(pdserve_pb2.AbortRequest(request_id="http-id"), metadata=auth(KEY_B),
                                            timeout=5)
                    by_a = await stub.Abort(pdserve_pb2.AbortRequest(request_id="http-id"), metadata=auth(KEY_A2),
                                            timeout=5)
                text = await asyncio.wait_for(http, 30)
            return by_b.found, by_a.found, text

    by_b, by_a, text = asyncio.run(main())
    assert (by_b, by_a) == (False, True)  # old code: no one could abort an HTTP request by its id
    assert '"finish_reason": "abort"' in text  # the stream ended, and says why
