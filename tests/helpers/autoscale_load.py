"""Fast autoscaling settings (windows and cooldowns of seconds) and a load of random-token
prompts sent at a fixed pace, for the served autoscaling test and benchmarks/autoscale.py."""

import asyncio

import grpc
import torch

from pdserve.protos import pdserve_pb2, pdserve_pb2_grpc

FAST = dict(window_s=3.0, scale_up_cooldown_s=2.0, scale_down_cooldown_s=5.0, max_replicas=2, max_sample_age_s=5.0,
            slo_s=600.0)


async def send_load(address: str, n: int, every_s: float, prompt_len: int, max_tokens: int = 3) -> list[int]:
    async def one(i: int) -> int:
        ids = torch.randint(100, 40000, (prompt_len,), generator=torch.Generator().manual_seed(i)).tolist()
        req = pdserve_pb2.GenerateRequest(token_ids=pdserve_pb2.TokenIds(ids=ids),
                                          sampling=pdserve_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        got = 0
        async for r in stub.Generate(req, timeout=300):
            got += len(r.token_ids)
        return got

    async with grpc.aio.insecure_channel(address) as ch:
        stub = pdserve_pb2_grpc.GenerationStub(ch)
        tasks = []
        for i in range(n):
            tasks.append(asyncio.create_task(one(i)))
            await asyncio.sleep(every_s)
        return await asyncio.gather(*tasks)
