"""The reversed pull's two turns between a real prefill and a real decode worker, as a router
would drive them over their stubs, and the checks after (tests/prefill_worker/test_prefix_pull.py
on the CPU, tests/gpu/test_prefix_pull_on_device.py on the check's device)."""

import asyncio

from pdserve.decode_worker.worker import DecodeWorker
from pdserve.prefill_worker.worker import PrefillWorker
from pdserve.protos import pdserve_pb2, worker_pb2

BLOCK, ANSWER, MAX_TOKENS, NUM_BLOCKS = 16, 24, 8, 64


def sampling(max_tokens: int) -> pdserve_pb2.SamplingParams:
    return pdserve_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)


async def first_turn(d_stub, prompt: list[int]) -> list[int]:
    """The first turn, prefilled and decoded on the decode worker: its answer."""
    request = worker_pb2.DecodeRequest(request_id="turn-1", prompt_token_ids=prompt, local_prefill=True,
                                       sampling=sampling(ANSWER))
    out = []
    async for resp in d_stub.Decode(request, timeout=120):
        out += [resp.prefilled.first_token_id] if resp.HasField("prefilled") else list(resp.token_ids)
    return out


async def second_turn(p_stub, d_stub, prompt: list[int], prefix: worker_pb2.KVHandle):
    """The second turn: prefilled on the prefill worker with ``prefix``, decoded on the decode
    worker. (The prefill answer, every token.)"""
    answer = await p_stub.Prefill(worker_pb2.PrefillRequest(request_id="turn-2", prompt_token_ids=prompt,
                                                            sampling=sampling(MAX_TOKENS), router_id="router-a",
                                                            prefix=prefix), timeout=120)
    request = worker_pb2.DecodeRequest(request_id="turn-2", prompt_token_ids=prompt, first_token_id=answer.first_token_id,
                                       sampling=sampling(MAX_TOKENS), kv=answer.kv)
    tokens = [answer.first_token_id] + [t async for resp in d_stub.Decode(request, timeout=120) for t in resp.token_ids]
    return answer, tokens


async def settled(prefill: PrefillWorker, decoder: DecodeWorker) -> tuple[int, int, int]:
    """(leases held on either side, free blocks on each) once every lease has ended, with the
    block managers' invariants checked; fails if a lease is stranded."""
    for _ in range(200):
        if not prefill.leases and not len(decoder.prefix_holds):
            break
        await asyncio.sleep(0.05)
    for worker in (prefill, decoder):
        await worker.call(worker.engine.blocks.check_invariants)
    return (len(prefill.leases) + len(decoder.prefix_holds), prefill.engine.blocks.num_free_blocks,
            decoder.engine.blocks.num_free_blocks)


async def still_held(decoder: DecodeWorker) -> int:
    """The holds left on the decode worker once a read's notice (or a release) had time to land."""
    for _ in range(40):
        if not len(decoder.prefix_holds):
            break
        await asyncio.sleep(0.05)
    return len(decoder.prefix_holds)
