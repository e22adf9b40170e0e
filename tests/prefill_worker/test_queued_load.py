"""A prefill worker's reported queue (``num_waiting_tokens``, the load routers balance and the
prefill autoscaling signal) leaves out queued prompt tokens its prefix cache already holds."""

import asyncio

from pdserve.engine.sampling.params import SamplingParams
from pdserve.prefill_worker.worker import PrefillWorker
from tests.factories import make_engine, prefill_worker_config, random_prompts

SYSTEM = random_prompts(1, [48], seed=31)[0]  # 3 blocks of 16
QUESTIONS = random_prompts(3, [5, 9, 12], seed=32)


def test_queued_tokens_the_cache_holds_are_not_load(tiny_llama_dir):
    worker = PrefillWorker(prefill_worker_config(kv_transfer_backend="tcp"), engine=make_engine(tiny_llama_dir[0]))
    params = SamplingParams(max_tokens=2)
    worker.engine.generate([SYSTEM + QUESTIONS[0]], params)  # the prefix is now cached

    async def inline(fn, *args):  # the engine thread is not started: the prompts stay queued
        return fn(*args)

    worker.call = inline

    async def queue_two() -> int:
        hit = asyncio.create_task(worker.prefill("hit#0", SYSTEM + QUESTIONS[1], params))
        cold = asyncio.create_task(worker.prefill("cold#0", random_prompts(1, [60], seed=33)[0], params))
        logprobs = asyncio.create_task(worker.prefill("lp#0", SYSTEM + QUESTIONS[2],
                                                      SamplingParams(max_tokens=2, prompt_logprobs=0)))
        await asyncio.sleep(0.05)
        reported = worker.stats().num_waiting_tokens
        for task in (hit, cold, logprobs):
            task.cancel()
        return reported

    try:
        reported = asyncio.run(queue_two())
    finally:
        worker.agent.close()
    # 57 - 48 cached, 60 cold, 60 with prompt logprobs (which never use the cache).
    assert reported == (48 + 9 - 48) + 60 + (48 + 12)
