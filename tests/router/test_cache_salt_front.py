"""The router's part of tenant isolation in the prefix cache: a client's ``cache_salt`` (gRPC
``sampling.cache_salt``, the OpenAI body's ``cache_salt``) reaches the workers, and with an API
key configured every request is salted by the caller's tenant (a hash, never the key itself).
Real gRPC and HTTP fronts over fake workers that record what they were sent; the engine's
part (no hit across salts) is tests/engine/test_cache_salt.py."""

import asyncio
import json
from types import SimpleNamespace

import aiohttp
import grpc

from pdserve.protos import pdserve_pb2, pdserve_pb2_grpc
from pdserve.router import http_api
from pdserve.router.auth import ApiKeyInterceptor, ApiKeys
from pdserve.router.frontend import ModelInfo
from pdserve.router.limits import RouterLimits
from pdserve.router.service import GenerationService
from tests.metrics.metrics_helpers import FakeDecode, FakePrefill, LetterTokenizer, fake_pool
from pdserve.wire.grpc_util import aio_server, bind

KEY = "sk-tenant-secret-123"


class RecordingPrefill(FakePrefill):
    def __init__(self):
        super().__init__()
        self.salts: list[str] = []

    async def Prefill(self, request, timeout=None):
        self.salts.append(request.sampling.cache_salt)
        return await super().Prefill(request, timeout)


def service(prefill, api_key: str | None) -> GenerationService:
    model = ModelInfo("m", SimpleNamespace(vocab_size=1000), 4096, 16, LetterTokenizer())
    return GenerationService(model, fake_pool([prefill], [FakeDecode()]), RouterLimits(),
                             keys=ApiKeys.single(api_key) if api_key else None)


def grpc_salts(api_key: str | None, client_salts: list[str]) -> list[str]:
    """The salt the prefill worker saw for each request sent over real gRPC."""
    async def main():
        prefill = RecordingPrefill()
        server = aio_server([ApiKeyInterceptor(api_key)] if api_key else ())
        address = bind(server, "127.0.0.1", 0)
        service(prefill, api_key).add_to(server)
        await server.start()
        metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = pdserve_pb2_grpc.GenerationStub(channel)
                for salt in client_salts:
                    req = pdserve_pb2.GenerateRequest(token_ids=pdserve_pb2.TokenIds(ids=[5, 6, 7]),
                                                      sampling=pdserve_pb2.SamplingParams(max_tokens=2, cache_salt=salt))
                    [r async for r in stub.Generate(req, timeout=30, metadata=metadata)]
        finally:
            await server.stop(None)
        return prefill.salts

    return asyncio.run(main())


def test_a_clients_salt_reaches_the_workers_unchanged_without_a_key():
    assert grpc_salts(None, ["team-a", ""]) == ["team-a", ""]


def test_with_an_api_key_every_request_is_salted_by_its_tenant():
    keyed, plain = grpc_salts(KEY, ["", "team-a"]), grpc_salts(None, ["", "team-a"])
    assert keyed[0] and KEY not in keyed[0]  # the default: a hash of the key, never the key
    assert keyed[1] not in (keyed[0], "team-a") and KEY not in keyed[1]  # a client salt subdivides it
    assert grpc_salts(KEY, [""]) == keyed[:1]  # stable: the same key shares its own cache
    assert keyed != plain


def test_the_openai_body_cache_salt_reaches_the_workers():
    async def main():
        prefill = RecordingPrefill()
        runner, address = await http_api.start(service(prefill, None), "127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession() as session:
                body = json.dumps({"prompt": [5, 6], "max_tokens": 2, "cache_salt": "team-b"}).encode()
                async with session.post(f"http://{address}/v1/completions", data=body) as r:
                    assert r.status == 200, await r.text()
        finally:
            await runner.cleanup()
        return prefill.salts

    assert asyncio.run(main()) == ["team-b"]
