"""Two tenants on real workers (tiny float32 model, real gRPC servers and the tcp KV backend in
this process, the router's real pool, KV index and gRPC front with its API keys): B never sees
A's prefix-cache hits, not in ``cached_tokens``, not in the router's KV index (prefix routing),
not even by sending A's own cache salt as its ``cache_salt``; A's hits are there for A."""

import asyncio
from types import SimpleNamespace

import pytest

from pdserve.protos import pdserve_pb2, pdserve_pb2_grpc
from pdserve.router.auth import ApiKeyInterceptor, ApiKeys
from pdserve.router.cache_salt import request_salt
from pdserve.router.frontend import ModelInfo
from pdserve.router.limits import RouterLimits
from pdserve.router.service import GenerationService
from pdserve.router.tenants import Tenant, key_digest
from pdserve.wire.grpc_util import aio_channel, aio_server, bind
from tests.helpers.kv_routing import BLOCK, QUESTIONS, SYSTEM, cluster
from tests.metrics.metrics_helpers import LetterTokenizer

pytestmark = pytest.mark.slow

KEY_A, KEY_B = "sk-tenant-a-cache-0001", "sk-tenant-b-cache-0002"
A, B = Tenant("team-a"), Tenant("team-b")
KEYS = ApiKeys(((key_digest(KEY_A), A), (key_digest(KEY_B), B)))


async def generate(stub, key: str, prompt: list[int], cache_salt: str = "") -> tuple[list[int], int]:
    """(tokens, cached_tokens) of one greedy request through the router's gRPC front."""
    req = pdserve_pb2.GenerateRequest(token_ids=pdserve_pb2.TokenIds(ids=prompt), sampling=pdserve_pb2.SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True, cache_salt=cache_salt))
    resps = [r async for r in stub.Generate(req, metadata=(("authorization", f"Bearer {key}"),), timeout=120)]
    return [t for r in resps for t in r.token_ids], resps[-1].usage.cached_prompt_tokens


def test_b_never_sees_as_cache_hits(tiny_llama_dir):
    async def run():
        async with cluster(tiny_llama_dir[0], prefill_blocks=64) as (pool, _):
            model = ModelInfo("tiny", SimpleNamespace(vocab_size=512), 2048, BLOCK, LetterTokenizer())
            service = GenerationService(model, pool, RouterLimits(), keys=KEYS)
            server = aio_server([ApiKeyInterceptor(KEYS)])
            address = bind(server, "127.0.0.1", 0)
            service.add_to(server)
            await server.start()
            try:
                async with aio_channel(address, None) as ch:
                    stub = pdserve_pb2_grpc.GenerationStub(ch)
                    await generate(stub, KEY_A, SYSTEM + QUESTIONS[0])
                    await pool.refresh()  # the router's index learns A's blocks
                    workers = list(pool.workers)
                    index = {who: pool.index.overlaps(SYSTEM + QUESTIONS[1], workers, salt)
                             for who, salt in (("a", A.salt), ("b", B.salt), ("b-forged", request_salt(A.salt, B.salt)))}
                    b = await generate(stub, KEY_B, SYSTEM + QUESTIONS[1])
                    b_forged = await generate(stub, KEY_B, SYSTEM + QUESTIONS[1], cache_salt=A.salt)
                    a = await generate(stub, KEY_A, SYSTEM + QUESTIONS[1])
            finally:
                await server.stop(None)
            return index, a, b, b_forged

    index, (a_tokens, a_cached), (b_tokens, b_cached), (forged_tokens, forged_cached) = asyncio.run(run())
    assert a_cached == 3 * BLOCK  # A's own prefix is A's hit: the cache works
    assert b_cached == 0 and forged_cached == 0  # old code (one shared cache): 3 * BLOCK for B too
    assert max(index["a"].values()) == 3 * BLOCK
    assert not any(index["b"].values()) and not any(index["b-forged"].values())
    assert b_tokens == a_tokens == forged_tokens  # the same prompt, the same greedy tokens
